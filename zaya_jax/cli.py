"""The ``zaya`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zaya_jax.checkpoint import CheckpointSaveError
from zaya_jax.config import Config, ConfigError, available_presets, load_config, parse_override, to_dict
from zaya_jax.files import storage_error_message
from zaya_jax.resilience import NonFiniteLossError


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def _cmd_convert(args: argparse.Namespace) -> int:
    """Both directions write their output beside ``dst`` and rename it into place when complete
    (:mod:`zaya_jax.staging`): a killed conversion leaves no half-written ``dst``, and the same
    command can be rerun; a rerun over a finished conversion checks that it holds the same result."""
    from zaya_jax import checkpoint
    from zaya_jax.config import RunConfig
    from zaya_jax.interop.hf import load_hf_directory
    from zaya_jax.staging import StagedDirectory, is_empty_dir

    if args.direction == "zaya-to-hf":
        from zaya_jax.lm import export_hf

        _, step = export_hf(args.src, args.dst, dtype=args.dtype)
        print(f"{args.dst}: step {step} of {args.src} in HF format ({args.dtype})")
        return 0
    dst = Path(args.dst)
    converted_before = (dst / "config.yaml").is_file() and (dst / checkpoint.CHECKPOINTS).is_dir()
    if dst.exists() and not is_empty_dir(dst) and not converted_before:
        raise SystemExit(f"zaya convert: {dst} exists and is not empty; choose a new destination")
    overrides = {}
    for text in args.set:
        keys, value = parse_override(text)
        if len(keys) != 2 or keys[0] != "model":
            raise ConfigError(f"--set {text!r} must look like model.KEY=VALUE")
        overrides[keys[1]] = value
    model_cfg, variables = load_hf_directory(args.src, **overrides)
    cfg = Config(run=RunConfig(name=dst.name, dir=str(dst)), model=model_cfg)
    cfg.validate()
    with StagedDirectory(dst, "zaya convert hf-to-zaya") as staged:
        checkpoint.save_model(staged.path, cfg, variables, step=0)
        staged.publish_or_match(_same_converted_run)
    print(
        f"{dst / checkpoint.CHECKPOINTS / '0'}: {model_cfg.num_layers} layers, {model_cfg.num_experts} experts"
    )
    return 0


def _same_converted_run(new: Path, existing: Path) -> bool:
    """Whether a run directory written by ``zaya convert hf-to-zaya`` holds what ``new`` holds: the
    same config.yaml bytes and one checkpoint (step 0) with the same config and arrays, bit for bit
    (Orbax's files themselves differ between two writes: random file names and timestamps)."""
    import jax
    import numpy as np

    from zaya_jax import checkpoint

    if (new / "config.yaml").read_bytes() != (existing / "config.yaml").read_bytes():
        return False
    names = {p.name for p in (existing / checkpoint.CHECKPOINTS).iterdir()}
    if sorted(names) != ["0"] or sorted(p.name for p in existing.iterdir()) != ["checkpoints", "config.yaml"]:
        return False
    try:
        cfg_a, vars_a, _ = checkpoint.restore_model(new)
        cfg_b, vars_b, _ = checkpoint.restore_model(existing)
    except Exception:
        return False
    leaves_a, tree_a = jax.tree.flatten(vars_a)
    leaves_b, tree_b = jax.tree.flatten(vars_b)
    return (
        cfg_a == cfg_b
        and tree_a == tree_b
        and all(
            a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(leaves_a, leaves_b, strict=True)
        )
    )


def _cmd_inspect(args: argparse.Namespace) -> int:
    from zaya_jax import checkpoint
    from zaya_jax.model import param_counts

    if (args.path is None) == (args.config is None):
        raise SystemExit("zaya inspect: give a checkpoint PATH or --config NAME (not both)")
    report: dict[str, Any]
    if args.config is not None:
        cfg = load_config(args.config, args.overrides)
        report = {"config": to_dict(cfg), **param_counts(cfg.model)}
        if args.optimizer:
            from zaya_jax.optim import describe_groups

            report["optimizer"] = describe_groups(cfg.model, cfg.optim.router_group)
    elif (Path(args.path) / "config.json").is_file():  # an HF save_pretrained directory
        from zaya_jax.interop.hf import hf_directory_model
        from zaya_jax.interop.safetensors_io import tensor_shapes

        model_cfg = hf_directory_model(args.path)
        tensors = tensor_shapes(args.path)
        report = {
            "format": "hf",
            "config": {"model": to_dict(model_cfg)},
            **param_counts(model_cfg),
            "arrays": {"tensors": tensors},
        }
    else:
        cfg, step = checkpoint.read_config(args.path)
        _, arrays = checkpoint.array_metadata(args.path)
        report = {"step": step, "config": to_dict(cfg), **param_counts(cfg.model), "arrays": arrays}
    if args.json:
        _print_json(report)
        return 0
    for key in ("step", "total_params", "non_embedding_params", "active_params"):
        if key in report:
            print(f"{key:>22}: {report[key]:,}")
    if "optimizer" in report:
        for path, info in report["optimizer"].items():
            axes = f" matrix {info['matrix_axes']} batch {info['batch_axes']}" if info["matrix_axes"] else ""
            print(f"  {info['group']:>5}  {path} {info['shape']}{axes}")
    if "arrays" in report:
        import jax

        for item, tree in report["arrays"].items():
            leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
            for keypath, (shape, dtype) in leaves:
                print(f"  {item}{jax.tree_util.keystr(keypath)}: {dtype}{list(shape)}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from zaya_jax.parallel.distributed import Launch
    from zaya_jax.train.loop import train

    if args.help_config is not None:
        from zaya_jax.config_reference import help_text

        print(help_text(args.help_config or None))
        return 0
    cfg = _train_config(args)
    if args.compile_only:
        return _compile_only(cfg, args.devices, args.target)
    launch = Launch(args.coordinator, args.num_processes, args.process_id)
    summary = train(cfg, progress=not args.no_progress, hooks=args.hooks, launch=launch)
    _print_json(summary)
    return 0


def _train_config(args: argparse.Namespace) -> Config:
    """The preset with the overrides; with ``train.init_from`` (or ``--init-from``) the model section
    is the source's, and ``model.*`` overrides apply on top of it."""
    overrides = [*args.overrides, *([f"train.init_from={args.init_from}"] if args.init_from else [])]
    cfg = load_config(args.config, overrides)
    if not cfg.train.init_from:
        return cfg
    from zaya_jax.train.init import source_model_config

    return load_config(args.config, overrides, model=to_dict(source_model_config(cfg.train.init_from)))


def _compile_only(cfg: Config, devices: int | None, target: str) -> int:
    """Plan ``target``'s program on ``devices`` fake CPU devices (set before JAX starts its backends)."""
    if devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        ).strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    from zaya_jax.train.plan import compile_plan

    report = compile_plan(cfg, target)
    _print_json(report)
    for warning in report["gemm_tile_warnings"]:
        print(f"zaya train --compile-only: warning: {warning}", file=sys.stderr)
    return 0


def _default_compilation_cache() -> None:
    """eval and generate use the default persistent compilation cache (runtime.compilation_cache_dir)."""
    from zaya_jax.config import RuntimeConfig
    from zaya_jax.parallel.distributed import enable_compilation_cache

    enable_compilation_cache(RuntimeConfig().compilation_cache_dir)


def _cmd_eval(args: argparse.Namespace) -> int:
    from zaya_jax.lm import evaluate_path

    _default_compilation_cache()
    result = evaluate_path(
        args.path,
        args.data,
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_batches=args.batches,
        progress=sys.stderr.isatty(),
    )
    print(f"zaya eval: {result.pop('evaluated')}", file=sys.stderr)
    if args.json:
        _print_json(result)
    else:
        print(
            f"loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.3f} over {result['tokens']:,} tokens"
        )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from zaya_jax.data import load_tokenizer
    from zaya_jax.lm import load

    _default_compilation_cache()
    lm = load(args.path)
    if args.tokenizer:
        lm.tokenizer = load_tokenizer(args.tokenizer)
    if args.interactive:
        return _interactive(lm, args)
    if not args.prompt:
        raise ValueError(
            "give a prompt (--prompt TEXT, repeatable) or --interactive to read prompts from stdin"
        )
    out = lm.generate(args.prompt, **_sampling(args))
    results = [
        {"prompt": prompt, "text": text, "tokens": row, "stopped": bool(stopped)}
        for prompt, text, row, stopped in zip(args.prompt, out.texts, out.rows(), out.stopped, strict=True)
    ]
    if args.json:
        _print_json(results)
    else:
        for result in results:
            print(result["prompt"] + result["text"])
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options of ``zaya generate``, as keyword arguments of ``LanguageModel.generate``."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "stop_tokens": args.stop,
        "seed": args.seed,
    }


def _interactive(lm: Any, args: argparse.Namespace) -> int:
    """Prompts from stdin, one per line, each left-padded to ``--max-prompt-tokens``: every prompt
    has the same shape, so the program compiles once."""
    import numpy as np

    if lm.tokenizer is None:
        raise ValueError("--interactive needs a tokenizer: pass --tokenizer PATH (or 'byte')")
    width = args.max_prompt_tokens
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        if not prompt:
            continue
        ids = lm.tokenizer.encode(prompt)
        if len(ids) > width:
            print(
                f"zaya generate: the prompt has {len(ids)} tokens, more than --max-prompt-tokens={width}",
                file=sys.stderr,
            )
            continue
        padded = np.full((1, width), lm.config.pad_token_id, np.int32)
        padded[0, width - len(ids) :] = ids
        mask = (np.arange(width) >= width - len(ids))[None].astype(np.int32)
        out = lm.generate(padded, attention_mask=mask, **_sampling(args))
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.texts[0], "tokens": out.rows()[0]}), flush=True)
        else:
            print(prompt + out.texts[0], flush=True)
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    import time

    from zaya_jax.data import prepare

    started = time.perf_counter()
    manifest = prepare(
        args.inputs,
        args.out,
        tokenizer_spec=args.tokenizer,
        num_shards=args.shards,
        on_bad_document=args.on_bad_document,
        text_field=args.text_field,
    )
    summary = {k: v for k, v in manifest.items() if k != "shards"}
    _print_json({**summary, "seconds": round(time.perf_counter() - started, 3)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zaya", description="ZAYA1-style MoE language models in JAX.")
    parser.add_argument("--version", action="version", version=f"zaya-jax {_version()}")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    _add_train_command(sub)
    _add_eval_command(sub)
    _add_generate_command(sub)
    _add_data_command(sub)
    _add_convert_command(sub)
    _add_inspect_command(sub)
    _add_supervise_command(sub)
    _add_doctor_command(sub)
    return parser


def _add_train_command(sub: Any) -> None:
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
    dist = train.add_argument_group(
        "multi-process (default: ZAYA_* variables, then Slurm/MPI/JobSet detection)"
    )
    dist.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    dist.add_argument("--num-processes", type=int, help="number of processes in the job")
    dist.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")
    train.set_defaults(func=_cmd_train)


def _add_eval_command(sub: Any) -> None:
    evaluate = sub.add_parser(
        "eval", help="held-out loss and perplexity of a run, checkpoint or HF directory"
    )
    evaluate.add_argument("path", help="run directory, checkpoint directory or HF save_pretrained directory")
    evaluate.add_argument(
        "--data",
        nargs="*",
        default=[],
        help="text/.jsonl/.parquet inputs (default: the run's held-out split)",
    )
    evaluate.add_argument(
        "--tokenizer",
        help="'byte' or a tokenizer.json (default: the run's, or the HF directory's tokenizer.json)",
    )
    evaluate.add_argument(
        "--seq-len",
        type=int,
        help="tokens per row (default: a run's train.seq_len and held-out batches, else 512)",
    )
    evaluate.add_argument(
        "--batch-size", type=int, help="rows per batch (default: the run's train.batch_size, else 8)"
    )
    evaluate.add_argument(
        "--batches",
        type=int,
        help="at most this many batches (default: the run's train.eval_batches, else 16)",
    )
    evaluate.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens"}')
    evaluate.set_defaults(func=_cmd_eval)


def _add_generate_command(sub: Any) -> None:
    gen = sub.add_parser("generate", help="continue text prompts with the CCA decode cache")
    gen.add_argument("path", help="run directory, checkpoint directory or HF save_pretrained directory")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    gen.add_argument(
        "--interactive",
        action="store_true",
        help="read prompts from stdin, one per line, compiling once (prompts padded to --max-prompt-tokens)",
    )
    gen.add_argument("--max-prompt-tokens", type=int, default=256, help="with --interactive: longest prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--stop", type=int, action="append", help="stop token id (default: the tokenizer's EOS)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's)")
    gen.add_argument("--json", action="store_true", help='print [{"prompt", "text", "tokens", "stopped"}]')
    gen.set_defaults(func=_cmd_generate)


def _add_data_command(sub: Any) -> None:
    data = sub.add_parser("data", help="data preparation")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="tokenize inputs into ArrayRecord shards plus a manifest")
    prepare.add_argument(
        "inputs",
        nargs="+",
        help="text files, directories, globs, .jsonl or .parquet files (.gz/.zst compressed too)",
    )
    prepare.add_argument("--out", required=True, help="new output directory")
    prepare.add_argument("--tokenizer", default="byte", help="'byte' or a path to an HF tokenizer.json")
    prepare.add_argument("--shards", type=int, default=4, help="number of ArrayRecord shards")
    prepare.add_argument(
        "--text-field",
        default="text",
        help="the JSONL field / Parquet column holding the text (default: text)",
    )
    prepare.add_argument(
        "--on-bad-document",
        choices=["error", "skip"],
        default="error",
        help="a document that cannot be read: stop with its name (default) or skip and count it",
    )
    prepare.set_defaults(func=_cmd_data_prepare)


def _add_convert_command(sub: Any) -> None:
    convert = sub.add_parser(
        "convert", help="convert between Hugging Face directories and zaya-jax checkpoints"
    )
    convert.add_argument("direction", choices=["hf-to-zaya", "zaya-to-hf"], help="conversion direction")
    convert.add_argument(
        "src", help="HF save_pretrained directory (new or legacy layout), or a zaya run/checkpoint"
    )
    convert.add_argument("dst", help="new directory: a zaya run (hf-to-zaya) or an HF save_pretrained dir")
    convert.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="zaya-to-hf weight dtype"
    )
    convert.add_argument(
        "--set", action="append", default=[], metavar="model.KEY=VALUE", help="override a model config value"
    )
    convert.set_defaults(func=_cmd_convert)


def _add_inspect_command(sub: Any) -> None:
    inspect = sub.add_parser("inspect", help="parameter counts, config, and checkpoint contents")
    inspect.add_argument(
        "path", nargs="?", help="run, checkpoint or HF save_pretrained directory (arrays are not loaded)"
    )
    inspect.add_argument("--config", help=f"preset name or YAML path ({', '.join(available_presets())})")
    inspect.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. model.num_layers=4")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--optimizer",
        action="store_true",
        help="each parameter's optimizer group (muon/adamw) and matrix axes",
    )
    inspect.set_defaults(func=_cmd_inspect)


def _add_supervise_command(sub: Any) -> None:
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


def _add_doctor_command(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor", help="platform, devices, versions and the custom-call kernels per platform"
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--require-gpu",
        action="store_true",
        help="exit 1 if JAX runs on the CPU (a silent fallback from a GPU)",
    )
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
    args = build_parser().parse_args(child[child.index("train") :])
    return load_config(args.config, args.overrides).run.path


def _cmd_doctor(args: argparse.Namespace) -> int:
    import importlib.metadata as metadata
    import platform as host

    import flax
    import jax
    import jaxlib
    import optax

    from zaya_jax import ops
    from zaya_jax.ops._registry import LIB_DIR

    kernels = ops.kernel_status()
    for name, status in kernels.items():  # registered with XLA, but nothing here will run it
        if status == "registered" and name != "cpu":
            try:
                jax.devices(name)
            except RuntimeError:
                kernels[name] = "built, no device"
    backend = jax.default_backend()
    platform = jax.devices()[0].platform if backend != "cpu" else "cpu"
    plugins = {
        dist.metadata["Name"]: dist.version
        for dist in metadata.distributions()
        if (dist.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax-rocm", "jax_cuda", "jax_rocm"))
    }
    # Flags worth setting per platform (MoE on MI300X: ragged_dot as hipBLASLt grouped GEMM, bf16).
    try:
        version = str(jax.devices()[0].client.platform_version).lower()
    except AttributeError:
        version = ""
    recommended = {"rocm": ["--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"]}.get(
        "rocm" if "rocm" in version else platform, []
    )
    flags = os.environ.get("XLA_FLAGS", "")
    report = {
        "python": host.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "plugins": plugins,
        "kernels": kernels,
        "kernels_dir": str(LIB_DIR),
        "recommended_xla_flags": {flag: flag.split("=")[0] in flags for flag in recommended},
    }
    if args.require_gpu and backend == "cpu":
        print(
            "zaya doctor: a GPU was required but JAX runs on the CPU. Install the plugin "
            '(pip install -e ".[rocm]" or ".[cuda]"), check ROCR_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, '
            f"and that the driver is visible; installed plugins: {plugins or 'none'}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if key == "kernels":
                for platform, status in value.items():
                    print(f"kernels[{platform}]: {status}")
            else:
                print(f"{key}: {value}")
    return 0


def _version() -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version("zaya-jax")
    except metadata.PackageNotFoundError:
        return "unknown"


# Subcommands whose options may come after their positional arguments (``zaya train k=v --no-progress
# k2=v2``): parsed with argparse's intermixed parsing. ``supervise`` passes its tail on untouched.
_INTERMIXED = ("train", "eval", "generate", "inspect", "convert")


def _config_section_flags(tokens: list[str]) -> list[str]:
    """``--train.steps 10`` / ``--train.steps=10`` (Levanter's shape) -> ``train.steps=10``."""
    from zaya_jax.config import Config

    sections = {f.name for f in dataclasses.fields(Config)}
    out, i = [], 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:].partition("=")[0]
        if token.startswith("--") and "." in name and name.split(".")[0] in sections:
            if "=" in token:
                out.append(token[2:])
            elif i + 1 < len(tokens):
                out.append(f"{name}={tokens[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"{token} needs a value: {token} VALUE or {name}=VALUE")
        else:
            out.append(token)
        i += 1
    return out


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = next((t for t in argv if not t.startswith("-")), None)
    if command not in _INTERMIXED:
        return parser.parse_args(argv)
    index = argv.index(command)
    if index:  # top-level options before the subcommand (--version, --help)
        parser.parse_args(argv[:index])
    args = subparsers.choices[command].parse_intermixed_args(_config_section_flags(argv[index + 1 :]))
    args.subcommand = command
    return args


def _positional_config(args: argparse.Namespace) -> None:
    """``zaya train my.yaml k=v`` / ``zaya train small k=v`` (MaxText's shape): a first positional
    that is a preset name or a YAML file is the config."""
    if args.subcommand != "train" or not args.overrides:
        return
    first = args.overrides[0]
    if "=" in first:
        return
    if first in available_presets() or first.endswith((".yaml", ".yml")):
        if args.config not in (None, "tiny") and args.config != first:
            raise ConfigError(f"two configs given: --config {args.config} and {first}; give one")
        args.config, args.overrides = first, args.overrides[1:]


def _inspect_positionals(args: argparse.Namespace) -> None:
    """``zaya inspect`` takes a path, or a config and overrides: a first positional that is not an
    existing path is a preset/YAML (``zaya inspect small``) or an override (``model.num_layers=4``)."""
    if not args.path or Path(args.path).exists():
        return
    if args.path in available_presets() or args.path.endswith((".yaml", ".yml")):
        if args.config is not None:
            raise ConfigError(f"two configs given: --config {args.config} and {args.path}; give one")
        args.config, args.path = args.path, None
    elif "=" in args.path or ("." in args.path and "/" not in args.path):
        args.overrides, args.path = [args.path, *args.overrides], None
        args.config = args.config or "tiny"


def main(argv: Sequence[str] | None = None, *, hooks: Sequence[Any] = ()) -> int:
    """Run one ``zaya`` command; returns its exit code. ``hooks`` are passed to ``zaya train``'s
    loop (:class:`zaya_jax.train.hooks.Hook`; the tests' fault injection)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(parser, argv)
        args.hooks = tuple(hooks)
        if args.subcommand == "inspect":
            _inspect_positionals(args)
        _positional_config(args)
        return args.func(args)
    except ConfigError as err:
        print(f"zaya {_name(argv)}: configuration error: {err}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, NonFiniteLossError) as err:
        print(f"zaya {_name(argv)}: {err}", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"zaya {_name(argv)}: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only or forbidden directory
        print(f"zaya {_name(argv)}: {storage_error_message(err)}", file=sys.stderr)
        return 1


def _name(argv: list[str]) -> str:
    """The subcommand, for error messages (``data prepare``: both words)."""
    words = [t for t in argv if not t.startswith("-")]
    if not words:
        return ""
    return " ".join(words[:2]) if words[0] == "data" and len(words) > 1 else words[0]


if __name__ == "__main__":
    sys.exit(main())
