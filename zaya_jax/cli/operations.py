"""``zaya supervise`` and ``zaya doctor``: a training command kept alive across crashes and hangs, and
what this machine runs on."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zaya_jax.config import load_config


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_supervise_command(sub)
    _add_doctor_command(sub)


def _add_supervise_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sup = sub.add_parser(
        "supervise",
        help="run a command (zaya train ...) and restart it on crash or hang, from its last checkpoint",
    )
    sup.add_argument(
        "--max-restarts", type=int, default=5, help="give up after more failures than this in --window"
    )
    sup.add_argument("--window", type=float, default=3600.0, help="seconds over which failures are counted")
    sup.add_argument("--backoff", type=float, default=5.0, help="first restart delay in seconds (doubles)")
    sup.add_argument("--max-backoff", type=float, default=300.0, help="longest restart delay in seconds")
    sup.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=0.0,
        help="kill and restart the child when <run>/heartbeat.json is older than this (0: rely on the "
        "trainer's own watchdog, resilience.hang_timeout_s)",
    )
    sup.add_argument(
        "--run-dir", help="where events.jsonl goes (default: the run directory of the train command)"
    )
    sup.add_argument("command", nargs=argparse.REMAINDER, help="-- zaya train [options]")
    sup.set_defaults(func=_cmd_supervise)


def _add_doctor_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor", help="platform, devices, versions and the custom-call kernels per platform"
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--require-gpu",
        action="store_true",
        help="exit 1 if JAX runs on the CPU (a silent fallback from a GPU)",
    )
    doctor.add_argument(
        "--flags-for",
        choices=["cuda", "rocm"],
        help="print the XLA flags recommended on that GPU platform, with their reasons, and exit",
    )
    doctor.add_argument(
        "--moe",
        action="store_true",
        help="time every dropless MoE path (forward + backward) at a config's per-device shapes on this "
        "machine's first device, print the timings and moe_impl auto's choice, and cache it",
    )
    doctor.add_argument(
        "--config", default="tiny", help="with --moe: the preset or YAML whose shapes to time"
    )
    doctor.add_argument("overrides", nargs="*", default=[], help="with --moe: dotted config overrides")
    doctor.set_defaults(func=_cmd_doctor)


def _cmd_supervise(args: argparse.Namespace) -> int:
    from zaya_jax.resilience.supervise import supervise_command

    child = list(args.command)
    if child and child[0] == "--":
        child = child[1:]
    if not child:
        raise ValueError(
            "nothing to supervise: give the command after --, e.g. zaya supervise -- zaya train ..."
        )
    run_dir = Path(args.run_dir) if args.run_dir else _run_dir_of(child)
    return supervise_command(
        child,
        run_dir,
        max_restarts=args.max_restarts,
        window_s=args.window,
        backoff_s=args.backoff,
        max_backoff_s=args.max_backoff,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


def _run_dir_of(child: list[str]) -> Path:
    """The run directory a ``zaya train`` command line writes to (its config resolved the way the
    trainer resolves it)."""
    if "train" not in child:
        raise ValueError(f"cannot tell the run directory of {' '.join(child)!r}: pass --run-dir")
    from zaya_jax.cli import train

    parser = argparse.ArgumentParser(prog="zaya")
    train.register(parser.add_subparsers(dest="subcommand", required=True))  # zaya train's own arguments
    args = parser.parse_args(child[child.index("train") :])
    return load_config(args.config, args.overrides).run.path


def _cmd_doctor(args: argparse.Namespace) -> int:
    from zaya_jax.cli.doctor import no_gpu_message, platform_report

    if args.flags_for:
        from zaya_jax.cli.doctor import RECOMMENDED_XLA_FLAGS, timeout_settings

        for flag, why in RECOMMENDED_XLA_FLAGS[args.flags_for].items():
            print(f"{flag}\n    {why}")
        overrides, flags, env = timeout_settings(args.flags_for)
        print(f"# collective timeouts: set {' '.join(overrides)} (the trainer applies these:)")
        for flag in flags:
            acts = "is reported" if "warn_stuck" in flag else "ends the process (zaya supervise restarts it)"
            print(f"{flag}\n    a collective stuck this many seconds {acts}")
        for name, value in env.items():
            print(f"{name}={value}\n    the IB / RoCE transport retries a link for runtime.network_retry_s")
        return 0
    if args.moe:
        return _doctor_moe(args)
    report = platform_report()
    if args.require_gpu and report["backend"] == "cpu":
        print(f"zaya doctor: {no_gpu_message(report['plugins'])}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report.items():
        if key == "kernels":
            for platform, status in value.items():
                print(f"kernels[{platform}]: {status}")
        elif key == "kernel_plan":
            for setting, plan in value.items():
                what = (
                    ", ".join(f"{op} {impl}" for op, impl in plan.items()) if isinstance(plan, dict) else plan
                )
                print(f"kernels={setting}: {what}")
        elif key == "recommended_xla_flags":
            for flag, state in value.items():
                print(f"{'set' if state['set'] else 'NOT SET'}: {flag}\n    {state['why']}")
        else:
            print(f"{key}: {value}")
    return 0


def _doctor_moe(args: argparse.Namespace) -> int:
    """``zaya doctor --moe``: measure (never from the cache) and cache moe_impl auto's choice."""
    import jax

    from zaya_jax.ops.kernel_plan import device_platform
    from zaya_jax.parallel import make_layout
    from zaya_jax.programs.moe import cache_path, measure, resolve_moe_impl, tokens_per_device

    cfg = load_config(args.config, [*args.overrides, "model.moe_impl=auto"])
    layout = make_layout(cfg)
    _, choice = resolve_moe_impl(cfg, layout, remeasure=True)
    report = {**choice.record(), "cache": str(cache_path())}
    if device_platform() == "rocm":  # the grouped-GEMM flag is process-wide: timed here, set by the user
        device = jax.local_devices()[0]
        extra = measure(
            cfg.model,
            tokens_per_device(cfg, layout),
            device,
            ("sorted",),
            variants=("sorted_grouped_gemm",),
            kernel=layout.kernels.moe_gemm == "kernel",
        )
        report["seconds"] = {**report["seconds"], "sorted_grouped_gemm": extra["sorted_grouped_gemm"]}
        report["xla_flag"] = "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"moe: {choice.key or args.config}")
    for impl, seconds in sorted(report["seconds"].items(), key=lambda kv: kv[1]):
        print(f"  {impl:8s} {seconds * 1e3:9.2f} ms per forward + backward")
    print(f"moe_impl auto -> {choice.impl} ({choice.source}); cached in {cache_path()}")
    if "xla_flag" in report:
        print(
            f"sorted_grouped_gemm is sorted compiled with {report['xla_flag']} (process-wide: set it in XLA_FLAGS)"
        )
    return 0
