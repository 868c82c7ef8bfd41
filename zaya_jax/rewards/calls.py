"""``rl.reward`` as a run calls it: the function imported from ``"module:function"``, every call
held to ``rl.reward_timeout`` seconds, optionally in ``rl.reward_workers`` processes, and every
failure (an exception, a value that is not a finite number, a call past its time) reported with
the function, what it did and the prompt: the run stops (``rl.on_reward_error: stop``) or the
prompt's group is skipped and counted (``skip``).

The time limit is a ``SIGALRM`` timer around the call in the process that makes it (the trainer's
main thread, or a worker's), raising :class:`RewardTimeout`, a ``BaseException`` so that a reward
function's own ``except Exception`` cannot swallow it. A call stuck where Python cannot interrupt
it (inside a C extension) is caught in the pool by the parent's deadline, which ends the workers
and starts new ones. Workers are ``spawn`` processes (a forked JAX process is not safe), started
once per run, each importing the reward module itself; the standard library's
``multiprocessing.Pool`` is used because it can be terminated while a call hangs, which
``concurrent.futures`` cannot.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import numbers
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from zaya_jax.config import ConfigError
from zaya_jax.rewards import prompt_messages

Reward = Callable[[dict[str, Any], str], float]


class RewardError(ValueError):
    """The reward function failed, or returned something that is not a reward (``rl.on_reward_error: stop``)."""


class RewardTimeout(BaseException):
    """A reward call ran past ``rl.reward_timeout`` (a ``BaseException``: ``except Exception`` in the
    reward function does not stop it)."""


@contextlib.contextmanager
def _working_directory_importable() -> Iterator[None]:
    """The working directory at the end of ``sys.path`` while a reward module is imported: the
    ``zaya`` command (a console script) does not put it there, ``python -m`` does."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import_failure(spec: str, module_name: str, err: BaseException) -> ConfigError:
    """One line for a reward module that cannot be imported: what failed, and where."""
    if isinstance(err, ModuleNotFoundError) and err.name and module_name.startswith(err.name):
        return ConfigError(
            f"rl.reward={spec!r}: no module named {err.name!r}; a reward module is imported from the "
            "working directory, PYTHONPATH or an installed package (rl.reward=MODULE:FUNCTION)"
        )
    frames = traceback.extract_tb(err.__traceback__)
    where = (
        f" ({frames[-1].filename}:{frames[-1].lineno})" if frames and not isinstance(err, SyntaxError) else ""
    )
    return ConfigError(
        f"rl.reward={spec!r}: importing {module_name!r} failed{where}: {type(err).__name__}: {err}; fix the module"
    )


def load_reward(spec: str) -> Reward:
    """``"module:function"`` -> the function (called as ``function(record, completion_text)``);
    ``module`` is imported from ``sys.path`` and then the working directory. Any failure is one
    :class:`ConfigError` naming ``rl.reward`` (a module that raises or does not compile included)."""
    module_name, _, name = spec.partition(":")
    try:
        with _working_directory_importable():
            module = importlib.import_module(module_name)
    except Exception as err:  # anything the user's module raises at import, SyntaxError included
        raise _import_failure(spec, module_name, err) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: {module_name} has no function {name!r}")
    return fn


def _prompt_text(record: dict[str, Any]) -> str:
    messages = prompt_messages(record) if isinstance(record.get("messages"), list) else []
    text = " | ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return text if len(text) <= 120 else text[:117] + "..."


def _expire(limit: float):
    def handler(signum, frame):
        raise RewardTimeout(f"ran past rl.reward_timeout={limit:g} s")

    return handler


def call_limited(fn: Reward, record: dict[str, Any], text: str, limit: float) -> tuple[Any, str | None]:
    """``(value, None)`` from ``fn(record, text)`` run for at most ``limit`` seconds (0: no limit;
    off the main thread no timer can be set, and the call runs unlimited), or ``(None, problem)``
    when it raised, ran out of time or returned something that is not a finite number."""
    timed = limit > 0 and threading.current_thread() is threading.main_thread()
    if timed:
        previous = signal.signal(signal.SIGALRM, _expire(limit))
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        value = fn(record, text)
    except RewardTimeout as err:
        return None, str(err)
    except (Exception, SystemExit) as err:  # the user's function: reported, never a traceback
        return None, f"raised {type(err).__name__}: {err}"
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return value, None
    return None, f"returned {value!r} ({type(value).__name__}), not a finite number"


_WORKER: dict[str, Any] = {}


def _start_worker(spec: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and ends the pool
    _WORKER["fn"] = load_reward(spec)


def _worker_call(record: dict[str, Any], text: str, limit: float) -> tuple[Any, str | None]:
    return call_limited(_WORKER["fn"], record, text, limit)


class RewardFunction:
    """``rl.reward`` as the run calls it: ``reward(record, text)`` or ``reward.score(records, texts)``
    gives finite numbers (a :class:`zaya_jax.rewards.Score` keeps its ``parsed`` flag), or None
    where the function failed and ``rl.on_reward_error`` is ``skip`` (counted in :attr:`errors`; the
    first problem kept in :attr:`problem`). With ``stop`` (the default) a failure is a
    :class:`RewardError` naming the function, what it did and the prompt. ``timeout``: seconds per
    call (0: none); ``workers``: processes that score a batch in parallel (0: this process)."""

    def __init__(self, spec: str, on_error: str = "stop", timeout: float = 0.0, workers: int = 0):
        self.spec, self.on_error, self.timeout, self.workers = spec, on_error, timeout, workers
        self.fn = load_reward(spec)
        self.errors = 0
        self.problem: str | None = None
        self._pool: Any = None

    def __call__(self, record: dict[str, Any], text: str) -> float | None:
        return self._checked(record, *call_limited(self.fn, record, text, self.timeout))

    def score(self, records: Sequence[dict[str, Any]], texts: Sequence[str]) -> list[float | None]:
        """Each ``(record, text)`` pair's reward, in order: in this process, or in the pool."""
        if self.workers <= 0 or len(texts) <= 1:
            return [self(record, text) for record, text in zip(records, texts, strict=True)]
        outcomes = self._pooled(records, texts)
        return [self._checked(r, *o) for r, o in zip(records, outcomes, strict=True)]

    def _pooled(
        self, records: Sequence[dict[str, Any]], texts: Sequence[str]
    ) -> list[tuple[Any, str | None]]:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.workers, initializer=_start_worker, initargs=(self.spec,))
        pending = [
            self._pool.apply_async(_worker_call, (record, text, self.timeout))
            for record, text in zip(records, texts, strict=True)
        ]
        # the workers' own timers cut a call at its limit; this deadline catches one they cannot
        # interrupt (a C extension), with room for every call of the batch at its limit
        rounds = math.ceil(len(pending) / self.workers)
        deadline = None if self.timeout <= 0 else 2 * self.timeout * rounds + 30
        outcomes: list[tuple[Any, str | None]] = []
        for result in pending:
            try:
                outcomes.append(result.get(deadline))
            except multiprocessing.TimeoutError:
                outcomes.append((None, f"did not return in {deadline:g} s (rl.reward_timeout={self.timeout:g}), "
                                       "stuck where its timer cannot stop it; the reward workers were restarted"))  # fmt: skip
                self.close()
                break
        for _ in range(len(pending) - len(outcomes)):  # the calls the restart abandoned
            outcomes.append((None, "abandoned when the reward workers were restarted after a stuck call"))
        return outcomes

    def _checked(self, record: dict[str, Any], value: Any, problem: str | None) -> float | None:
        if problem is None:
            return value if hasattr(value, "parsed") else float(value)
        where = getattr(record, "where", None)
        problem = f"rl.reward={self.spec} {problem} for the prompt {_prompt_text(record)!r}" + (
            f" ({where})" if where else ""
        )
        if self.on_error == "stop":
            self.close()
            raise RewardError(
                f"{problem}; fix the function, or set rl.on_reward_error=skip to skip that prompt's group "
                "(counted as reward_errors)"
            )
        self.errors += 1
        self.problem = self.problem or problem
        return None

    def close(self) -> None:
        """End the worker processes (a later :meth:`score` starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
