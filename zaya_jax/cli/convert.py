"""``zaya convert`` and ``zaya inspect``: model files moved between the Hugging Face format and
zaya-jax runs, and their contents (config, parameter counts, array shapes) shown without loading them;
``zaya inspect DATA_DIR --rows N`` shows a prepared directory's packed rows."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from zaya_jax.cli.output import print_json
from zaya_jax.config import Config, ConfigError, available_presets, load_config, parse_override, to_dict


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_convert_command(sub)
    _add_inspect_command(sub)


def _add_convert_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    convert = sub.add_parser(
        "convert", help="convert between Hugging Face directories and zaya-jax checkpoints"
    )
    convert.add_argument("direction", choices=["hf-to-zaya", "zaya-to-hf"], help="conversion direction")
    convert.add_argument(
        "src", help="HF save_pretrained directory (new or legacy layout), or a zaya run/checkpoint"
    )
    convert.add_argument("dst", help="new directory: a zaya run (hf-to-zaya) or an HF save_pretrained dir")
    convert.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="zaya-to-hf weight dtype (default float32; bfloat16 outside the experts with --quantize)",
    )
    convert.add_argument(
        "--quantize",
        choices=["none", "fp8-experts", "mxfp4-experts"],
        help="zaya-to-hf: the experts in compressed-tensors' FP8 (e4m3, a scale per output channel) or "
        "MXFP4 (e2m1, a scale per 32 inputs) format, the rest in --dtype (default: the model's own "
        "model.expert_quantization); a LoRA run is merged first",
    )
    convert.add_argument(
        "--merge",
        action="store_true",
        help="zaya-to-hf of a LoRA run: one HF model with the adapters merged into its weights",
    )
    convert.add_argument(
        "--adapter",
        action="store_true",
        help="zaya-to-hf of a LoRA run: a PEFT adapter directory (for PeftModel on its base's HF export)",
    )
    convert.add_argument(
        "--set", action="append", default=[], metavar="model.KEY=VALUE", help="override a model config value"
    )
    convert.set_defaults(func=_cmd_convert)


def _add_inspect_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = sub.add_parser(
        "inspect", help="parameter counts, config, and checkpoint contents; packed rows of prepared data"
    )
    inspect.add_argument(
        "path",
        nargs="?",
        help="run, checkpoint or HF save_pretrained directory (arrays are not loaded), or a directory "
        "written by zaya data prepare",
    )
    inspect.add_argument(
        "--rows",
        type=int,
        default=0,
        help="prepared data: show the first N packed rows as text, trained targets between « and »",
    )
    inspect.add_argument("--seq-len", type=int, default=256, help="prepared data: row length (default 256)")
    inspect.add_argument("--config", help=f"preset name or YAML path ({', '.join(available_presets())})")
    inspect.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. model.num_layers=4")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--optimizer",
        action="store_true",
        help="each parameter's optimizer group (muon/adamw) and matrix axes",
    )
    inspect.set_defaults(func=_cmd_inspect)


def _cmd_convert(args: argparse.Namespace) -> int:
    """Both directions write their output beside ``dst`` and rename it into place when complete
    (:mod:`zaya_jax.staging`): a killed conversion leaves no half-written ``dst``, and the same
    command can be rerun; a rerun over a finished conversion checks that it holds the same result."""
    from zaya_jax import checkpoint
    from zaya_jax.config import DataConfig, RunConfig
    from zaya_jax.interop.hf import load_hf_directory
    from zaya_jax.staging import StagedDirectory, is_empty_dir

    if args.direction == "zaya-to-hf":
        from zaya_jax.lm import export_hf

        quantized = args.quantize not in (None, "none")
        dtype = args.dtype or ("bfloat16" if quantized else "float32")
        _, step = export_hf(
            args.src, args.dst, dtype=dtype, merge=args.merge, adapter=args.adapter, quantize=args.quantize
        )
        experts = f", experts {args.quantize.removesuffix('-experts')}" if quantized else ""
        what = (
            "a PEFT adapter"
            if args.adapter
            else f"HF format ({dtype}{experts}{', merged' if args.merge else ''})"
        )
        print(f"{args.dst}: step {step} of {args.src} as {what}")
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
    tokenizer = Path(args.src) / "tokenizer.json"
    # The model's own tokenizer, copied beside it; a model converted without one has none ("none")
    # until one is given: a guessed tokenizer would limit or mistranslate its ids in silence.
    spec = str(dst.resolve() / "tokenizer.json") if tokenizer.is_file() else "none"
    cfg = Config(run=RunConfig(name=dst.name, dir=str(dst)), model=model_cfg, data=DataConfig(tokenizer=spec))
    cfg.validate()
    with StagedDirectory(dst, "zaya convert hf-to-zaya") as staged:
        checkpoint.save_model(staged.path, cfg, variables, step=0)
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, staged.path / "tokenizer.json")
        staged.publish_or_match(checkpoint.same_model_run)
    print(
        f"{dst / checkpoint.CHECKPOINTS / '0'}: {model_cfg.num_layers} layers, {model_cfg.num_experts} experts"
    )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from zaya_jax.model import param_counts

    if (args.path is None) == (args.config is None):
        raise SystemExit("zaya inspect: give a checkpoint PATH or --config NAME (not both)")
    if args.path is not None and _is_prepared(Path(args.path)):
        return _inspect_data(args)
    if args.rows:
        raise SystemExit(
            f"zaya inspect: --rows is for directories written by zaya data prepare, not {args.path}"
        )
    report: dict[str, Any]
    if args.config is not None:
        cfg = load_config(args.config, args.overrides)
        report = {"config": to_dict(cfg), **param_counts(cfg.model)}
        if args.optimizer:
            from zaya_jax.optim import describe_groups

            report["optimizer"] = describe_groups(cfg.model, cfg.optim.router_group)
    else:
        from zaya_jax.pretrained import describe_model

        report = {**describe_model(args.path), **_run_health(Path(args.path))}
    if args.json:
        print_json(report)
        return 0
    for key in ("step", "total_params", "non_embedding_params", "active_params"):
        if key in report:
            print(f"{key:>22}: {report[key]:,}")
    if "goodput" in report:
        from zaya_jax.resilience.goodput import describe

        print(f"{'goodput':>22}: {describe(report['goodput'])}")
    for entry in report.get("excluded_nodes", []):
        print(f"{'excluded node':>22}: {entry['node']} after step {entry['step']}: {entry['reason']}")
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


def _run_health(path: Path) -> dict[str, Any]:
    """A run directory's goodput over its attempts and the nodes its supervisor excluded."""
    from zaya_jax.resilience.goodput import attempts, totals
    from zaya_jax.resilience.supervise import excluded_nodes

    run = path if path.is_dir() and not path.name.isdigit() else path.parent.parent  # a run or its step
    found = {"goodput": totals(attempts(run)), "excluded_nodes": excluded_nodes(run)}
    return {key: value for key, value in found.items() if value}


def _is_prepared(path: Path) -> bool:
    """A directory written by ``zaya data prepare`` (its manifest or its shards, even damaged)."""
    from zaya_jax.data.prepared.format import MANIFEST

    return os.path.lexists(path / MANIFEST) or any(path.glob("shard-*.array_record"))


def _inspect_data(args: argparse.Namespace) -> int:
    from zaya_jax.data import read_manifest
    from zaya_jax.data.preview import preview_rows, row_summary, row_text

    manifest = read_manifest(args.path)
    summary = {k: v for k, v in manifest.items() if k not in ("shards", "inputs")}
    rows, tokenizer = preview_rows(args.path, args.rows, args.seq_len) if args.rows else ([], None)
    if args.json:
        print_json({**summary, "seq_len": args.seq_len, "rows": [row_summary(r) for r in rows]})
        return 0
    for key in ("documents", "tokens", "skipped_documents", "content"):
        if key in summary:
            print(
                f"{key:>18}: {summary[key]:,}"
                if isinstance(summary[key], int)
                else f"{key:>18}: {summary[key]}"
            )
    for i, row in enumerate(rows):
        info = row_summary(row)
        print(
            f"--- row {i}: {info['segments']} segment(s), {info['trained']} of {args.seq_len} targets trained, "
            f"{info['padding']} padding"
        )
        for j, text in enumerate(row_text(row, tokenizer), 1):
            print(f"[segment {j}] {text}")
    return 0
