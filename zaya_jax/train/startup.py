"""What a run says when it starts: the ``start`` event in ``events.jsonl`` and a few lines on
stderr (new, resumed or from weights; the model's size; devices and mesh)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import jax

from zaya_jax.config import Config, to_dict
from zaya_jax.train.metrics import MetricsWriter

if TYPE_CHECKING:
    from zaya_jax.parallel import Layout


def start_event(
    writer: MetricsWriter,
    cfg: Config,
    layout: Layout,
    peak: float,
    peak_source: str,
    resumed_after: int,
    initialized: dict[str, Any] | None,
    moe: dict[str, Any] | None = None,
) -> None:
    """The run's ``start`` event (peak FLOPs and their source, devices, processes, mesh, the kernel
    plan, XLA flags, runtime, how ``model.moe_impl`` was resolved with its timings, the expert
    exchange and its probe),
    and a few lines on stderr saying what is starting: a new run, a resumed one (``resumed_after``
    > 0) or one from existing weights (``initialized``)."""
    origin = f"resuming after step {resumed_after}" if resumed_after else "new run"
    origin = f"new run from the weights of {initialized['source']}" if initialized else origin
    from zaya_jax.model import param_counts
    from zaya_jax.model.counts import short_count

    writer.event(
        "start",
        peak_flops=peak,
        peak_source=peak_source,
        devices=jax.device_count(),
        processes=jax.process_count(),
        mesh=layout.describe(),
        kernels=layout.kernels.describe(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        runtime=to_dict(cfg.runtime),
        **({"moe": moe} if moe is not None else {}),
        **({"expert_exchange": layout.expert_exchange} if getattr(layout, "expert_exchange", None) else {}),
    )
    if writer.enabled:
        counts = param_counts(cfg.model)
        mesh = (
            " x ".join(f"{name} {size}" for name, size in layout.describe().items() if size > 1)
            or "one device"
        )
        print(
            f"zaya train: {writer.run_dir} ({origin})\n"
            f"zaya train: {short_count(counts['total_params'])} parameters ({short_count(counts['active_params'])} active), "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s), mesh {mesh}"
            + _plan_line(layout, cfg, counts),
            file=sys.stderr,
            flush=True,
        )


def _plan_line(layout: Layout, cfg: Config, counts: dict[str, int]) -> str:
    """What trains, when it is not every parameter (the parameter plan's line)."""
    line = layout.parameters.describe(cfg.model, counts["total_params"])
    return f"\nzaya train: {line}" if line else ""
