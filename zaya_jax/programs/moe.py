"""``model.moe_impl: auto``: the dropless MoE path chosen by measurement on the live device, resolved
for a run's programs.

The candidates compute the same function (every routed token gets its expert, nothing dropped), so
the choice changes speed and memory, never the model: ``sorted`` (tokens sorted by expert through a
grouped matmul: ``jax.lax.ragged_dot`` on GPUs, the blocked batched matmul on CPU) and ``dense``
(every expert on every token, E times the FLOPs, no sort or gather; wins where E is small and the
sort's small operations dominate). The ``capacity`` path drops tokens, so it is never chosen for
``auto``; the blocked matmul is not a GPU candidate (it copies each expert's weights per row block,
memory that grows with the tokens).

:func:`measure` times forward + backward of each candidate at the run's per-device shapes (tokens,
hidden size, experts, intermediate size, dtype), interleaving the candidates and keeping each one's
best round; :class:`ChoiceCache` keeps the choice per device kind and shapes in a JSON file
(:func:`cache_path`), so a second run (or a resumed one) takes the same path without measuring.

:func:`resolve_moe_impl` resolves it for a run: the tokens each device's expert layer sees per
micro-batch, measured (or cached) on this process's first device, the same choice on every process
(process 0's, broadcast), and a fixed choice where nothing can be measured: with expert parallelism
(the exchange runs the grouped matmul) and while planning a GPU program on CPU (the choice cached
for ``--gpu-kind``, else the GPU default, ``sorted``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config import Config, ModelConfig
from zaya_jax.model.experts import dense_experts, sorted_experts
from zaya_jax.ops.platform import planning_device_kind, planning_target
from zaya_jax.parallel import Layout
from zaya_jax.programs.memory import device_capacity, peak_bytes

PATHS: dict[str, Callable[..., jax.Array]] = {"sorted": sorted_experts, "dense": dense_experts}
# What an unresolved ``auto`` runs (a model traced outside a run), and auto with expert parallelism.
FALLBACK = "sorted"


@dataclasses.dataclass(frozen=True)
class MoeChoice:
    """The path ``auto`` resolved to, why, and the timings (seconds per forward + backward)."""

    impl: str
    source: str  # "measured", "cached", or the reason it was not measured
    key: str = ""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"impl": self.impl, "source": self.source, "key": self.key, "seconds": self.seconds}


def choice_key(cfg: ModelConfig, tokens: int, device: jax.Device, kernel: bool = False) -> str:
    """The cache key: device kind, the expert layer's shapes and dtype, and whether the grouped
    GEMM is the kernel plan's custom call."""
    return (
        f"{device.platform}:{device.device_kind}|tokens={tokens}|hidden={cfg.hidden_size}|experts={cfg.num_experts}"
        f"|inner={cfg.moe_intermediate_size}|{jnp.dtype(cfg.dtype).name}|{cfg.hidden_act}"
        + ("|grouped_kernel" if kernel else "")
    )


# Variants timed by ``zaya doctor --moe`` but never chosen by ``auto``: a path compiled with an XLA
# option that is process-wide (set in XLA_FLAGS), reported so that the user can set it.
OPTION_VARIANTS = {
    "sorted_grouped_gemm": ("sorted", {"xla_gpu_experimental_use_ragged_dot_grouped_gemm": True}),
}


def _program(
    impl: str,
    cfg: ModelConfig,
    tokens: int,
    device: jax.Device,
    options: dict[str, Any] | None = None,
    kernel: bool = False,
) -> tuple[jax.stages.Compiled, tuple[jax.Array, ...]]:
    """``impl``'s forward + backward (gradients of the inputs and both weights), compiled for
    ``device``, and its arguments: random tokens routed uniformly over the experts and the skip class.
    ``kernel``: the sorted path's grouped GEMM is the custom call (the kernel plan's ``moe_gemm``)."""
    dtype = jnp.dtype(cfg.dtype)
    experts, hidden, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(0)
    args = (
        rng.standard_normal((tokens, hidden)).astype(np.float32),
        rng.integers(0, experts + 1, size=tokens).astype(np.int32),
        rng.random(tokens).astype(np.float32),
        (rng.standard_normal((experts, hidden, 2 * inner)) / np.sqrt(hidden)).astype(np.float32),
        (rng.standard_normal((experts, inner, hidden)) / np.sqrt(inner)).astype(np.float32),
    )
    args = tuple(
        jax.device_put(jnp.asarray(a, a.dtype if a.dtype == np.int32 else dtype), device) for a in args
    )
    path, act = PATHS[impl], cfg.hidden_act
    if impl == "sorted":
        path = functools.partial(path, kernel=kernel)

    def loss(x, weight, wi, wo, choice):
        return jnp.sum(path(x, choice, weight, wi, wo, act).astype(jnp.float32))

    def step(x, choice, weight, wi, wo):
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, weight, wi, wo, choice)

    lowered = jax.jit(step).lower(*args)
    return (lowered.compile(compiler_options=options) if options else lowered.compile()), args


def measure(
    cfg: ModelConfig,
    tokens: int,
    device: jax.Device,
    candidates: Sequence[str] = tuple(PATHS),
    rounds: int = 3,
    variants: Sequence[str] = (),
    kernel: bool = False,
) -> dict[str, float]:
    """Seconds per forward + backward of each candidate (and of each of ``variants``, names of
    :data:`OPTION_VARIANTS`) at ``tokens`` tokens on ``device``: each compiled and run once, then
    ``rounds`` rounds over all of them in turn, best round kept. A candidate whose plan takes more
    than half of the device's memory is not run and not in the result (:func:`_within_memory`).
    ``kernel``: :func:`_program`'s."""
    programs = {impl: _program(impl, cfg, tokens, device, kernel=kernel) for impl in candidates}
    for name in variants:
        impl, options = OPTION_VARIANTS[name]
        programs[name] = _program(impl, cfg, tokens, device, options, kernel)
    programs = _within_memory(programs, device)
    for compiled, args in programs.values():
        jax.block_until_ready(compiled(*args))
    best = dict.fromkeys(programs, float("inf"))
    for _ in range(rounds):
        for impl, (compiled, args) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            best[impl] = min(best[impl], time.perf_counter() - start)
    return best


def _within_memory(
    programs: dict[str, tuple[jax.stages.Compiled, tuple[jax.Array, ...]]], device: jax.Device
) -> dict[str, tuple[jax.stages.Compiled, tuple[jax.Array, ...]]]:
    """The candidates whose compiled plan takes at most half of the device's memory (the run's
    state and step need the rest): a path that would exhaust the host (the dense path computes
    every expert for every token) is not run to be timed. When none fits, the one that plans
    least is kept."""
    capacity, _ = device_capacity(device=device)
    plans = {
        name: peak_bytes(memory) if (memory := compiled.memory_analysis()) is not None else 0
        for name, (compiled, _) in programs.items()
    }
    if capacity is None:
        return programs
    kept = {name: program for name, program in programs.items() if plans[name] <= capacity // 2}
    return kept or {min(plans, key=plans.get): programs[min(plans, key=plans.get)]}


class ChoiceCache:
    """Choices per key in one JSON file, written atomically (concurrent writers lose nothing worse
    than one's entry, re-measured next time)."""

    def __init__(self, path: Path | None):
        self.path = path

    def get(self, key: str) -> dict[str, Any] | None:
        return self._read().get(key)

    def put(self, key: str, choice: MoeChoice) -> None:
        if self.path is None:
            return
        entries = self._read()
        entries[key] = {"impl": choice.impl, "seconds": choice.seconds}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".moe_auto.")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:  # a read-only cache is not an error: the next run measures again
            pass

    def find(self, device_kind: str, shapes: str) -> tuple[str, dict[str, Any]] | None:
        """A choice measured on a device whose kind contains ``device_kind`` (any case) at the
        shapes part of a key (what follows its first ``|``): (key, entry), or None."""
        for key, entry in self._read().items():
            device, _, rest = key.partition("|")
            if rest == shapes and device_kind.lower() in device.lower():
                return key, entry
        return None

    def _read(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}


def choose(
    cfg: ModelConfig,
    tokens: int,
    device: jax.Device,
    cache: ChoiceCache,
    remeasure: bool = False,
    kernel: bool = False,
) -> MoeChoice:
    """The fastest dropless path for ``tokens`` tokens per device on ``device`` (the sorted path's
    grouped GEMM the custom call where ``kernel``): cached, or measured (and cached)."""
    key = choice_key(cfg, tokens, device, kernel)
    hit = None if remeasure else cache.get(key)
    if hit is not None and hit.get("impl") in PATHS:
        return MoeChoice(hit["impl"], "cached", key, hit.get("seconds", {}))
    candidates = tuple(PATHS)
    seconds = measure(cfg, tokens, device, candidates, kernel=kernel)
    choice = MoeChoice(min(seconds, key=seconds.get), "measured", key, seconds)
    cache.put(key, choice)
    return choice


def cache_path() -> Path:
    """``$ZAYA_CACHE_DIR/moe_auto.json``, else ``$XDG_CACHE_HOME/zaya-jax/moe_auto.json``."""
    if os.environ.get("ZAYA_CACHE_DIR"):
        return Path(os.environ["ZAYA_CACHE_DIR"]).expanduser() / "moe_auto.json"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return root / "zaya-jax" / "moe_auto.json"


def tokens_per_device(cfg: Config, layout: Layout) -> int:
    """Tokens one device's expert layer runs per micro-batch of the run's final batch."""
    mesh = dict(layout.mesh.shape)
    rows = cfg.train.batch_size // cfg.train.micro_batches
    split = int(np.prod([mesh.get(axis, 1) for axis in ("data", "fsdp", "expert")]))
    return max(1, rows // split) * max(1, cfg.train.seq_len // mesh.get("context", 1))


def _agreed(choice: MoeChoice) -> MoeChoice:
    """Process 0's choice on every process (each traces the same program)."""
    if jax.process_count() == 1:
        return choice
    from jax.experimental import multihost_utils

    names = list(PATHS)
    index = int(multihost_utils.broadcast_one_to_all(np.int32(names.index(choice.impl))))
    if names[index] == choice.impl:
        return choice
    return MoeChoice(names[index], "process 0's choice", choice.key, choice.seconds)


def _planned_choice(cfg: Config, layout: Layout) -> MoeChoice:
    """While planning another platform's program: the choice cached for the named device kind
    (``--gpu-kind``) at these shapes, else ``sorted``, saying which."""
    kind = planning_device_kind()
    shapes = choice_key(cfg.model, tokens_per_device(cfg, layout), _Device()).partition("|")[2]
    found = ChoiceCache(cache_path()).find(kind, shapes) if kind else None
    if found is not None and found[1].get("impl") in PATHS:
        key, entry = found
        return MoeChoice(entry["impl"], f"cached for {key.partition('|')[0]}", key, entry.get("seconds", {}))
    why = f"no choice cached for {kind!r} at these shapes" if kind else "no --gpu-kind named"
    return MoeChoice(
        FALLBACK,
        f"planned for {planning_target()} on {jax.default_backend()}: {why} (zaya doctor --moe on it)",
    )


class _Device:
    """A blank device for a cache key whose shapes part alone is compared."""

    platform, device_kind = "", ""


def resolve_moe_impl(cfg: Config, layout: Layout, remeasure: bool = False) -> tuple[Config, MoeChoice]:
    """``cfg`` with ``model.moe_impl: auto`` replaced by its choice, and the choice; other values
    are kept as configured."""
    model = cfg.model
    if model.moe_impl != "auto":
        return cfg, MoeChoice(model.moe_impl, "configured")
    if dict(layout.mesh.shape).get("expert", 1) > 1:
        choice = MoeChoice(FALLBACK, "expert parallelism (the exchange runs the grouped matmul)")
    elif planning_target() is not None and planning_target() != jax.default_backend():
        choice = _planned_choice(cfg, layout)
    else:
        device = jax.local_devices()[0]
        tokens, kernel = tokens_per_device(cfg, layout), layout.kernels.moe_gemm == "kernel"
        choice = _agreed(choose(model, tokens, device, ChoiceCache(cache_path()), remeasure, kernel))
    return dataclasses.replace(cfg, model=dataclasses.replace(model, moe_impl=choice.impl)), choice
