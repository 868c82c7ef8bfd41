"""Multi-process runs with JAX's own multi-controller runtime (``jax.distributed``).

One process per host (or per GPU) runs the same ``zaya train`` command. The coordinator comes from
the command line (``--coordinator HOST:PORT --num-processes N --process-id I``), from the
environment (``ZAYA_COORDINATOR``, ``ZAYA_NUM_PROCESSES``, ``ZAYA_PROCESS_ID``), or from JAX's
cluster auto-detection when a scheduler launched several tasks (Slurm ``srun``, Open MPI
``mpirun``, Kubernetes JobSet). A single process with none of these starts nothing.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import jax

from zaya_jax.config import ConfigError, RuntimeConfig

# Environment variables that mean "a scheduler started several processes of this job".
_SCHEDULERS = {
    "slurm": ("SLURM_NTASKS",),
    "openmpi": ("OMPI_COMM_WORLD_SIZE",),
    "kubernetes-jobset": ("JOBSET_NAME",),
}


def detect_scheduler(env: Mapping[str, str] = os.environ) -> str | None:
    """The scheduler that launched several tasks of this job, or None."""
    for name, keys in _SCHEDULERS.items():
        for key in keys:
            value = env.get(key)
            if value is None:
                continue
            if name == "kubernetes-jobset" or (value.isdigit() and int(value) > 1):
                return name
    return None


def apply_runtime(runtime: RuntimeConfig, env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Append ``runtime``'s XLA flags to ``XLA_FLAGS`` (before any backend starts) and set its RCCL /
    NCCL variables where the environment has none (the user's own value wins: RCCL reads them when
    its communicators start, at the first collective); returns the flags.

    A backend that is already running (a notebook that used JAX first) cannot take new flags: that
    is an error naming the fix rather than a silently ignored setting.
    """
    for name, value in runtime.environment().items():
        env.setdefault(name, value)
    present = env.get("XLA_FLAGS", "").split()
    flags = [flag for flag in runtime.flags() if flag not in present]  # applied before: a second run
    if not flags:
        return []
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ConfigError(
            f"runtime flags {flags} must be set before JAX starts; put them in XLA_FLAGS before importing "
            "JAX or run `zaya train` in a fresh process"
        )
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
    return flags


def compilation_cache_path(spec: str, env: Mapping[str, str] = os.environ) -> Path | None:
    """Where ``runtime.compilation_cache_dir`` puts the persistent compilation cache (None: off)."""
    if not spec:
        return None
    if spec != "auto":
        return Path(spec).expanduser()
    if env.get("ZAYA_CACHE_DIR"):
        return Path(env["ZAYA_CACHE_DIR"]).expanduser() / "xla"
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "zaya-jax" / "xla"


def enable_compilation_cache(spec: str) -> Path | None:
    """Turn on JAX's persistent compilation cache at ``compilation_cache_path(spec)``; an unusable
    directory only warns (compiling without a cache is slower, never wrong)."""
    path = compilation_cache_path(spec)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(
            f"compilation cache {path} cannot be created ({err}); compiling without it", stacklevel=2
        )
        return None
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        # JAX opens its cache once, at the first compilation after a directory is set; a process
        # that used another directory before (a notebook's earlier run) must reopen it.
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    return path


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] = os.environ,
    runtime: RuntimeConfig | None = None,
) -> dict[str, object]:
    """Start ``jax.distributed`` if this is a multi-process run; returns what was decided.

    Must run before anything touches a JAX backend. Explicit arguments win over ``ZAYA_*``
    variables, which win over scheduler auto-detection.
    """
    if jax.distributed.is_initialized():  # started before (a second run in the same process)
        return {"mode": "initialized", "num_processes": jax.process_count()}
    coordinator = coordinator or env.get("ZAYA_COORDINATOR")
    if num_processes is None and env.get("ZAYA_NUM_PROCESSES"):
        num_processes = int(env["ZAYA_NUM_PROCESSES"])
    if process_id is None and env.get("ZAYA_PROCESS_ID"):
        process_id = int(env["ZAYA_PROCESS_ID"])
    if coordinator:
        if num_processes is None or process_id is None:
            raise ConfigError(
                "a coordinator address needs --num-processes and --process-id "
                "(or ZAYA_NUM_PROCESSES and ZAYA_PROCESS_ID)"
            )
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id {process_id} must be in [0, --num-processes {num_processes})")
        jax.distributed.initialize(
            coordinator, num_processes=num_processes, process_id=process_id, **_timeouts(runtime)
        )
        return {"mode": "explicit", "coordinator": coordinator, "num_processes": num_processes}
    scheduler = detect_scheduler(env)
    if scheduler is not None:
        jax.distributed.initialize(
            **_timeouts(runtime)
        )  # JAX's cluster detection reads the scheduler's variables
        return {"mode": "auto", "scheduler": scheduler, "num_processes": jax.process_count()}
    return {"mode": "single"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a multi-process job (``zaya train --coordinator ...``); every field
    None: from ``ZAYA_*`` variables or the scheduler, or a single process."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def setup_runtime(runtime: RuntimeConfig, launch: Launch | None = None) -> dict[str, object]:
    """Everything a run needs of the process before it builds its programs, the same for
    ``zaya train`` and ``zaya_jax.train.train(cfg)`` from Python: the XLA flags, the persistent
    compilation cache and, for a multi-process job, ``jax.distributed``. Safe to call again in
    the same process (a notebook's second run). Returns what was set up."""
    launch = launch or Launch()
    flags = apply_runtime(runtime)
    cache = enable_compilation_cache(runtime.compilation_cache_dir)
    distributed = initialize(launch.coordinator, launch.num_processes, launch.process_id, runtime=runtime)
    return {"xla_flags": flags, "compilation_cache": str(cache) if cache else None, **distributed}


def _timeouts(runtime: RuntimeConfig | None) -> dict[str, int]:
    runtime = runtime or RuntimeConfig()
    return {
        "initialization_timeout": runtime.init_timeout_s,
        "heartbeat_timeout_seconds": runtime.heartbeat_timeout_s,
    }


_barriers = 0


def barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Wait until every process arrives, through the coordination service (not a device
    collective, so a slow peer, e.g. one still compiling, does not trip a collective timeout)."""
    global _barriers
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed

    _barriers += 1
    client = jax_distributed.global_state.client
    if client is None:  # pragma: no cover - multi-process without jax.distributed (e.g. TPU pods)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    client.wait_at_barrier(f"zaya:{_barriers}:{name}", timeout_in_ms=int(timeout_s * 1000))


_gathers = 0


def gather_strings(name: str, value: str, timeout_s: float = 3600.0) -> list[str] | None:
    """Every process's ``value``, in process order, through the coordination service's key-value
    store: a host-side exchange (three small RPCs per process), never queued behind the device's
    work as a collective would be. Every process must call it the same number of times. None
    where there is no coordination service (multi-process without ``jax.distributed``)."""
    global _gathers
    if jax.process_count() == 1:
        return [value]
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:  # pragma: no cover - e.g. TPU pods
        return None
    _gathers += 1
    directory = f"zaya_gather/{_gathers}/"
    client.key_value_set(f"{directory}{jax.process_index()}", value)
    client.wait_at_barrier(f"zaya_gather:{_gathers}:{name}", timeout_in_ms=int(timeout_s * 1000))
    table = dict(client.key_value_dir_get(directory))
    # every process read the previous round before it set its key of this one: drop ours from it
    client.key_value_delete(f"zaya_gather/{_gathers - 1}/{jax.process_index()}")
    return [table[f"{directory}{i}"] for i in range(jax.process_count())]
