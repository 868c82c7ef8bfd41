"""``zaya train``: a run from a preset or YAML config and dotted overrides, or (``--compile-only``) the
memory plan of its step without running it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from zaya_jax.cli.output import print_json
from zaya_jax.config import Config, available_presets, load_config, to_dict

if TYPE_CHECKING:
    from zaya_jax.parallel.distributed import Launch


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = sub.add_parser("train", help="train a model (default: the tiny preset on the built-in corpus)")
    train.add_argument(
        "--config", default="tiny", help=f"preset name or YAML path ({', '.join(available_presets())})"
    )
    train.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. train.steps=50")
    train.add_argument(
        "--no-progress", action="store_true", help="no progress bar (logs still go to metrics.jsonl)"
    )
    train.add_argument(
        "--help-config",
        nargs="?",
        const="",
        metavar="SECTION",
        help="list the config keys (of one SECTION: run, model, train, optim, ...) with their meaning",
    )
    train.add_argument(
        "--init-from",
        metavar="PATH",
        help="start from existing weights: a run, step or HF directory (train.init_from); the model "
        "config is taken from it",
    )
    train.add_argument(
        "--compile-only",
        action="store_true",
        help="lower and compile the step for the configured mesh, print per-device memory; no arrays",
    )
    train.add_argument("--devices", type=int, help="with --compile-only: plan on this many fake CPU devices")
    train.add_argument(
        "--target",
        choices=["gpu", "cpu"],
        default="gpu",
        help="with --compile-only: whose program to plan (default gpu: the GPU branch of every "
        "platform-dependent op, compiled by XLA:CPU with memory twins where needed)",
    )
    train.add_argument(
        "--gpu-kind",
        metavar="KIND",
        help="with --compile-only: plan the MoE path moe_impl auto measured on this GPU kind (a part of "
        "its device name, e.g. H200 or MI300X; from the cache zaya doctor --moe fills), else sorted",
    )
    train.add_argument(
        "--fit-device",
        metavar="KIND",
        help="with --compile-only: compare the plan with one device of this kind ("
        "l40s, h100, h200, b200, mi250x, mi300x, mi325x); exit 1 if it does not fit, warn under 20%% headroom",
    )
    dist = train.add_argument_group(
        "multi-process (default: ZAYA_* variables, then Slurm/MPI/JobSet detection)"
    )
    dist.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    dist.add_argument("--num-processes", type=int, help="number of processes in the job")
    dist.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")
    train.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    from zaya_jax.parallel.distributed import Launch
    from zaya_jax.train.loop import train

    if args.help_config is not None:
        from zaya_jax.config_reference import help_text

        print(help_text(args.help_config or None))
        return 0
    launch = Launch(args.coordinator, args.num_processes, args.process_id)
    cfg = _train_config(args, None if args.compile_only else launch)
    if args.compile_only:
        return _compile_only(cfg, args.devices, args.target, args.fit_device, args.gpu_kind)
    summary = train(cfg, progress=not args.no_progress, hooks=args.hooks, launch=launch)
    print_json(summary)
    return 0


def _train_config(args: argparse.Namespace, launch: Launch | None = None) -> Config:
    """The preset with the overrides; with ``train.init_from`` (or ``--init-from``) the model section
    is the source's, and ``model.*`` overrides apply on top of it. Reading the source starts a JAX
    backend, so a run's ``launch`` (jax.distributed) is set up before it."""
    overrides = [*args.overrides, *([f"train.init_from={args.init_from}"] if args.init_from else [])]
    cfg = load_config(args.config, overrides)
    if not cfg.train.init_from:
        return cfg
    from zaya_jax.parallel.distributed import setup_runtime
    from zaya_jax.train.init import source_model_config

    if launch is not None:
        setup_runtime(cfg.runtime, launch)

    return load_config(args.config, overrides, model=to_dict(source_model_config(cfg.train.init_from)))


def _compile_only(
    cfg: Config, devices: int | None, target: str, fit_device: str | None = None, gpu_kind: str | None = None
) -> int:
    """Plan ``target``'s program on ``devices`` fake CPU devices (set before JAX starts its backends);
    with ``fit_device``, the plan's headroom on one device of that kind."""
    from zaya_jax.train.fit import DEVICE_MEMORY_GB

    if fit_device is not None and fit_device.lower() not in DEVICE_MEMORY_GB:
        raise ValueError(f"--fit-device {fit_device!r} is not one of {', '.join(DEVICE_MEMORY_GB)}")
    if devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        ).strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    from zaya_jax.train.plan import compile_plan

    report = compile_plan(cfg, target, gpu_kind)
    if fit_device is not None:
        capacity = DEVICE_MEMORY_GB[fit_device.lower()] * 1e9
        peak = report["peak_bytes_per_device"]
        report["fit"] = {
            "device": fit_device.lower(),
            "capacity_bytes": int(capacity),
            "headroom": 1 - peak / capacity,
        }
    print_json(report)
    for warning in report["gemm_tile_warnings"]:
        print(f"zaya train --compile-only: warning: {warning}", file=sys.stderr)
    fit = report.get("fit")
    if fit is not None and fit["headroom"] < 0.2:
        print(
            f"zaya train --compile-only: {'warning: ' if fit['headroom'] >= 0 else ''}the plan peaks at "
            f"{report['peak_bytes_per_device'] / 1e9:.1f} GB per device, {1 - fit['headroom']:.0%} of one "
            f"{fit['device']} ({fit['capacity_bytes'] / 1e9:.0f} GB); raise train.micro_batches or set model.remat",
            file=sys.stderr,
        )
    return 1 if fit is not None and fit["headroom"] < 0 else 0
