"""The sections of a run around its step: ``run`` (the directory), ``log``, ``eval``, ``profile``
and ``checkpoint`` (what it writes, and when), ``runtime`` (backend, XLA and multi-process settings)
and ``resilience`` (what it does when a step goes wrong or stalls)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Literal

from zaya_jax.config.errors import ConfigError

HEALTH_PROBES = ("gpu", "nic", "filesystem", "clock")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run lives: ``dir`` defaults to ``runs/<name>``."""

    name: str = "zaya"  # run directory name under runs/ (a plain name, no '/')
    dir: str | None = None  # explicit run directory (overrides runs/<name>)

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name

    def validate(self) -> None:
        # The name becomes a directory under runs/: it must not climb out of it or nest.
        if (
            not self.name
            or self.name in (".", "..")
            or "/" in self.name
            or "\\" in self.name
            or "\0" in self.name
        ):
            raise ConfigError(
                f"run.name={self.name!r} must be a plain directory name (no '/', not '.' or '..'); "
                "use run.dir to place a run elsewhere"
            )


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """The metrics record (the ``Logging`` hook): written to ``metrics.jsonl`` every ``every`` steps
    and at every evaluated step, and to the ``trackers`` beside it."""

    every: int = 10  # steps between metrics records
    # Where metrics go besides metrics.jsonl (always written): "tensorboard" (tb/), "wandb" and
    # "trackio" (their extras; process 0 only; WANDB_MODE=offline / trackio's local store work
    # without a network).
    trackers: tuple[str, ...] = ("tensorboard",)
    project: str = "zaya-jax"  # the wandb / trackio project

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError(f"log.every={self.every} must be a positive integer")
        unknown = sorted(set(self.trackers) - {"tensorboard", "wandb", "trackio"})
        if unknown:
            raise ConfigError(f"log.trackers names {unknown}; use any of tensorboard, wandb, trackio")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The held-out loss during training (the ``Evaluation`` hook): ``batches`` batches of
    ``train.batch_size`` x ``train.seq_len`` tokens of the held-out split, every ``every`` steps and
    after the final step, and of the starting weights (``at_start``)."""

    every: int = 100  # steps between held-out evaluations
    batches: int = 4  # held-out batches per evaluation
    # Also evaluate the starting weights, logged as step 0, so a run shows where it started (a
    # resumed run has its step 0 already).
    at_start: bool = True

    def validate(self) -> None:
        for name in ("every", "batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name}={getattr(self, name)} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A ``jax.profiler`` trace (the ``Profiling`` hook) of the steps [first, last] into
    ``<run>/profile/``."""

    steps: tuple[int, ...] = ()  # [first, last] (empty: no trace)

    def validate(self) -> None:
        if self.steps and (len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1]):
            raise ConfigError(
                f"profile.steps={list(self.steps)} must be [first, last] with 1 <= first <= last"
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints in ``<run>/checkpoints/<step>/``: every ``every_steps`` steps and/or every
    ``every_minutes`` minutes (0: off; the final step is always saved), keeping the last ``keep``
    plus every ``keep_every``-th step (0: none) plus the ``keep_best`` steps of lowest held-out loss.
    Every decision is agreed by all processes (``zaya_jax.train.consensus``)."""

    every_steps: int = 0  # save every N steps (0: off)
    every_minutes: float = 0.0  # save every N minutes (0: off), by the clock of any process
    keep: int = 3  # most recent checkpoints kept
    keep_every: int = 0  # also keep every N-th step forever (0: none)
    # Also keep the N checkpoints of lowest held-out loss (0: off); every evaluated step is saved.
    keep_best: int = 0
    async_save: bool = True  # write in the background while training continues
    # Check every restored array against the fingerprint recorded when it was saved (a checkpoint
    # that fails is quarantined and the previous one used). Evaluation and export always verify.
    verify: bool = True
    # A local tier beside <run>/checkpoints: every process saves its own shards every
    # local_every_steps steps to fast local storage (a RAM disk or a local SSD:
    # <local_dir>/<run>-<hash>/process_<i>-of-<n>/checkpoints), keeping local_keep (>= 2 with
    # several processes); a restart restores the newest step every process holds and verifies,
    # local or persistent (docs/checkpoints.md).
    local_dir: str = ""
    local_every_steps: int = 0  # 0: no local tier
    local_keep: int = 2  # local steps kept

    def validate(self) -> None:
        for name in ("every_steps", "keep_every", "every_minutes", "keep_best"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)} must be >= 0")
        if self.keep < 1:
            raise ConfigError(
                f"checkpoint.keep={self.keep} must be >= 1 (the latest checkpoint is always kept)"
            )
        if self.local_every_steps < 0 or self.local_keep < 1:
            raise ConfigError(
                f"checkpoint.local_every_steps={self.local_every_steps} must be >= 0 and "
                f"checkpoint.local_keep={self.local_keep} >= 1"
            )
        if bool(self.local_dir) != bool(self.local_every_steps):
            raise ConfigError(
                "the local checkpoint tier needs both checkpoint.local_dir (a RAM disk or local SSD) and "
                f"checkpoint.local_every_steps (got {self.local_dir!r} and {self.local_every_steps})"
            )


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Backend and collective settings, applied before JAX starts its backends and recorded in the
    run's ``events.jsonl`` start event. Combine thresholds (0 = XLA's default) set how many bytes of
    small all-reduces / all-gathers / reduce-scatters XLA fuses into one collective on GPUs;
    ``xla_flags`` are appended to ``XLA_FLAGS`` as given. The timeouts govern the multi-process
    runtime: start-up, heartbeat (a silent process is declared dead after it) and barriers."""

    all_reduce_combine_threshold_bytes: int = 0  # XLA GPU all-reduce combining (0: XLA default)
    all_gather_combine_threshold_bytes: int = 0  # XLA GPU all-gather combining (0: XLA default)
    reduce_scatter_combine_threshold_bytes: int = 0  # XLA GPU reduce-scatter combining (0: XLA default)
    xla_flags: tuple[str, ...] = ()  # appended to XLA_FLAGS as given (--xla_NAME=VALUE)
    # Persistent XLA compilation cache, shared by train, eval, generate and supervised restarts:
    # "auto" = $ZAYA_CACHE_DIR/xla, else $XDG_CACHE_HOME/zaya-jax/xla (~/.cache/zaya-jax/xla); a path;
    # or "" (off). Programs that compile in under a second are not cached.
    compilation_cache_dir: str = "auto"
    init_timeout_s: int = 300  # multi-process start-up timeout
    heartbeat_timeout_s: int = 100  # a silent process is declared dead after this
    barrier_timeout_s: float = 3600.0  # limit of the trainer's barriers
    # A collective (a step) that has not returned after this long is a collective_timeout: XLA's
    # GPU runtime warns at half of it and ends the process at it, and the trainer's watchdog
    # classifies it and acts by resilience.on_unhealthy (0: XLA's defaults; zaya doctor --flags-for).
    collective_timeout_s: float = 0.0
    # How long RCCL / NCCL's InfiniBand / RoCE transport rides out a network blip before a
    # collective fails: NCCL_IB_TIMEOUT is set to cover it over the retries (0: the library's default).
    network_retry_s: float = 0.0
    network_retries: int = 0  # NCCL_IB_RETRY_CNT, 1-7 (0: the library's default, 7)
    # Before the first step, compare the compiled step's planned peak with the device's memory and
    # stop with settings that fit when it is larger (zaya_jax.train.fit).
    check_fit: bool = True
    memory_limit_gb: float = 0.0  # per device, for that check (0: the device's, or the host's RAM on CPU)

    def validate(self) -> None:
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            value = getattr(self, f"{name}_combine_threshold_bytes")
            if value < 0:
                raise ConfigError(
                    f"runtime.{name}_combine_threshold_bytes={value} must be >= 0 (0 = XLA default)"
                )
        if self.memory_limit_gb < 0:
            raise ConfigError(
                f"runtime.memory_limit_gb={self.memory_limit_gb} must be >= 0 (0 = the device's)"
            )
        for name in ("collective_timeout_s", "network_retry_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"runtime.{name}={getattr(self, name)} must be >= 0 (0: the default)")
        if not 0 <= self.network_retries <= 7:
            raise ConfigError(
                f"runtime.network_retries={self.network_retries} must be in 0-7 (0: the default, 7)"
            )
        for name in ("init_timeout_s", "heartbeat_timeout_s", "barrier_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"runtime.{name}={getattr(self, name)} must be > 0 seconds")
        for flag in self.xla_flags:
            if not flag.startswith("--xla_"):
                raise ConfigError(f"runtime.xla_flags entry {flag!r} must look like --xla_NAME=VALUE")

    def flags(self) -> list[str]:
        """The XLA flags this section adds."""
        out = [
            f"--xla_gpu_{name}_combine_threshold_bytes={getattr(self, f'{name}_combine_threshold_bytes')}"
            for name in ("all_reduce", "all_gather", "reduce_scatter")
            if getattr(self, f"{name}_combine_threshold_bytes")
        ]
        if self.collective_timeout_s:  # the first call also sets up the communicators: twice as long
            limit = max(2, math.ceil(self.collective_timeout_s))
            out += [
                f"--xla_gpu_executable_warn_stuck_timeout={limit // 2}",
                f"--xla_gpu_executable_terminate_timeout={limit}",
                f"--xla_gpu_first_collective_call_warn_stuck_timeout_seconds={limit}",
                f"--xla_gpu_first_collective_call_terminate_timeout_seconds={2 * limit}",
                f"--xla_gpu_nccl_termination_timeout_seconds={limit}",
            ]
        return [*out, *self.xla_flags]

    def environment(self) -> dict[str, str]:
        """The RCCL / NCCL variables this section sets (RCCL reads NCCL's names): the IB transport
        timeout is 4.096 us x 2^NCCL_IB_TIMEOUT per try, over NCCL_IB_RETRY_CNT + 1 tries."""
        env = {}
        retries = self.network_retries or 7
        if self.network_retries:
            env["NCCL_IB_RETRY_CNT"] = str(retries)
        if self.network_retry_s:
            exponent = math.ceil(math.log2(self.network_retry_s / ((retries + 1) * 4.096e-6)))
            env["NCCL_IB_TIMEOUT"] = str(min(31, max(1, exponent)))
        return env


@dataclasses.dataclass(frozen=True)
class ResilienceConfig:
    """What the trainer does when a step goes wrong or stops making progress."""

    # No step finished for this long (compilation included) -> dump every thread's stack to
    # <run>/hang_stacks.txt and exit with code 75 (a supervisor restarts it). 0: no watchdog.
    hang_timeout_s: float = 1800.0
    # The same limit while compiling, restoring, saving or starting (phases that legitimately
    # take long on big models).
    compile_timeout_s: float = 3600.0
    # A non-finite loss or gradient norm: "skip" the update, "rollback" to the last checkpoint and
    # skip the data since then, or "stop" the run (exit 1).
    on_nonfinite: Literal["skip", "rollback", "stop"] = "skip"
    # A loss spike (robust z-score of the loss against the last spike_window accepted steps above
    # spike_zscore): "none" (off), "skip" or "rollback", as above.
    on_spike: Literal["none", "skip", "rollback"] = "none"
    spike_zscore: float = 6.0  # robust z-score above which a loss is a spike
    spike_window: int = 100  # accepted losses the spike limit is computed from
    spike_warmup: int = 20  # accepted steps before spikes are judged
    # More rollbacks than this in one run stop it (the data, not one bad batch, is at fault).
    max_rollbacks: int = 5
    # Routing health (zaya_jax.resilience.routing), judged per layer on means over the last
    # routing_window steps: an expert load collapse, the skip fraction drifting from
    # balancing.skip_target, a balancing bias pinned at its clamp, router entropy collapse.
    # "warn" (a routing_alarm event and a line), "rollback" to the last checkpoint, "stop" (exit 1),
    # "none", or "skip": each step checks its own statistics (not windowed; no pinned-bias check) and
    # keeps the previous state when a layer is past a limit (a skip event, reason routing), the
    # windowed alarm reported as with warn.
    on_routing_alarm: Literal["none", "warn", "skip", "rollback", "stop"] = "warn"
    # A step whose metric passes its objective's bound (grpo: sampler_gap above rl.max_sampler_gap,
    # a batch the trainer does not reproduce): "stop" the run (exit 1) with the metric, its value,
    # the bound and the setting, or "skip" the batch (the step keeps its previous state; a skip
    # event and a line).
    on_metric_bound: Literal["skip", "stop"] = "stop"
    routing_window: int = 50  # steps the routing statistics are averaged over (and first judged after)
    # Steps of the run before routing is first judged: a fresh router takes a few hundred steps to
    # balance (tiny: an expert idle for 50 steps around step 100, max/min share <= 8.3 after step 300).
    routing_warmup: int = 300
    routing_max_load_ratio: float = 50.0  # max / min expert share of a layer's tokens (inf: an idle expert)
    routing_max_skip_drift: float = 0.5  # |skip share - balancing.skip_target|
    routing_min_entropy: float = 0.02  # router entropy / ln(E + 1), mean over tokens
    # Node health (zaya_jax.resilience.health): the probes run before the first step (a failing
    # node refuses to start, naming node and probe) and every health_every_s seconds. Any of gpu
    # (amd-smi / rocm-smi / nvidia-smi), nic (/sys/class/net, /sys/class/infiniband), filesystem
    # (room for the next checkpoint, write latency), clock (the processes' clocks, at the start only).
    health_probes: tuple[str, ...] = ("gpu", "nic", "filesystem", "clock")
    # Seconds between probes, in a thread off the step path (0: before the first step only).
    health_every_s: float = 60.0
    # A failing probe on any process: "drain" (every process saves at the next step boundary and
    # exits 76; zaya supervise, or Slurm through a requeue, restarts without the node), "stop" (exit
    # 77 without saving; the supervisor gives up), "warn" (an event and a line; training goes on).
    on_unhealthy: Literal["drain", "stop", "warn"] = "drain"
    health_interfaces: tuple[str, ...] = ()  # links that must be up (empty: those up at the start)
    # Where the nic probe reads the kernel's view of the links: a container that mounts the host's
    # /sys elsewhere (e.g. /host/sys) names it here.
    health_sys_root: str = "/sys"
    health_min_free_gb: float = 0.0  # a floor on free space (below two checkpoints fails anyway)
    health_max_write_latency_s: float = 10.0  # a slower 64 KiB durable write in the run directory warns
    health_max_clock_skew_s: float = 5.0  # processes' clocks further apart than this fail

    def validate(self) -> None:
        if self.hang_timeout_s < 0 or self.compile_timeout_s < 0:
            raise ConfigError(
                f"resilience.hang_timeout_s={self.hang_timeout_s} and compile_timeout_s={self.compile_timeout_s} "
                "must be >= 0 (0: off)"
            )
        if self.spike_zscore <= 0:
            raise ConfigError(f"resilience.spike_zscore={self.spike_zscore} must be > 0")
        if self.spike_window < 3 or self.spike_warmup < 3:
            raise ConfigError(
                f"resilience.spike_window={self.spike_window} and spike_warmup={self.spike_warmup} must be >= 3"
            )
        if self.max_rollbacks < 0:
            raise ConfigError(f"resilience.max_rollbacks={self.max_rollbacks} must be >= 0")
        if self.routing_warmup < 0:
            raise ConfigError(f"resilience.routing_warmup={self.routing_warmup} must be >= 0")
        if self.routing_window < 1:
            raise ConfigError(f"resilience.routing_window={self.routing_window} must be >= 1")
        if not self.routing_max_load_ratio > 1 or not 0 < self.routing_max_skip_drift <= 1:
            raise ConfigError(
                "resilience.routing_max_load_ratio must be > 1 and routing_max_skip_drift in (0, 1]"
            )
        if not 0 <= self.routing_min_entropy < 1:
            raise ConfigError(f"resilience.routing_min_entropy={self.routing_min_entropy} must be in [0, 1)")
        unknown = sorted(set(self.health_probes) - set(HEALTH_PROBES))
        if unknown:
            raise ConfigError(
                f"resilience.health_probes names {unknown}; use any of {', '.join(HEALTH_PROBES)}"
            )
        for name in ("health_every_s", "health_min_free_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"resilience.{name}={getattr(self, name)} must be >= 0")
        for name in ("health_max_write_latency_s", "health_max_clock_skew_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"resilience.{name}={getattr(self, name)} must be > 0 seconds")
