"""Training throughput of zaya-jax against HF transformers ``ZayaForCausalLM`` (PyTorch) and against
a dense model of equal active size, each framework in its own process.

One training step = forward, backward, gradient clipping and the optimizer update, on the same
batch of random token ids (next-token loss) and the same initial weights, float32:

* ``hf_adamw``: HF ``ZayaForCausalLM`` (built from the preset's model config), ``torch.optim.AdamW``
  (fused where PyTorch offers it) and ``clip_grad_norm_``;
* ``zaya_muon_<impl>``: zaya-jax's jitted train step as ``zaya train`` runs it (Muon+AdamW,
  balancing controller), per MoE path;
* ``zaya_adamw_<impl>``: the same step with every leaf on AdamW (the optimizer HF is run with);
* ``dense_muon``: zaya-jax with one expert instead of E (the dense model whose per-token active
  size equals the MoE's);
* ``hf_adamw@tcmalloc``: ``hf_adamw`` under tcmalloc, where it is installed (and
  ``hf_adamw@mimalloc`` with ``--allocators ... mimalloc``).

Allocators: each zaya worker runs under the allocator the ``zaya`` command would use
(``zaya_jax.allocator``: mimalloc from its wheel, else tcmalloc where installed); ``hf_adamw`` runs
under the C library's malloc, as ``python`` starts PyTorch, so the ratios are given against HF
under each. ``--allocators system tcmalloc mimalloc mimalloc-purge`` runs every zaya variant under
each allocator instead, side by side, and reports each worker's page faults, kernel time per step
and peak resident memory, and how many times fewer faults each variant took than under ``system``
(``page_faults_vs_system``).

Timing JAX and PyTorch in one process distorts both on a small machine (each framework's thread
pools compete: PyTorch ran 4-9x and JAX 1.2-2x slower than alone), so every variant is a worker
process. The workers are started (and compiled) first; then, round after round, each is told in
turn to run ``--steps`` steps while the others wait, so machine noise and drift hit all alike.
Reported: the median of the per-round medians, tokens/s, MFU (against a float32 matmul peak
measured by a zaya worker on CPU, the datasheet peak on a GPU) and every ratio against HF.

    python bench/train_vs_hf.py [--config tiny] [--batch 16] [--seq 128] [--rounds 5] [--steps 3]
                                [--impls sorted] [--set key=value ...] [--no-dense]
                                [--allocators auto|system|tcmalloc|mimalloc|mimalloc-purge ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from zaya_jax.allocator import allocator_env, find_mimalloc, find_tcmalloc, wanted_library


def _config(args):
    import zaya_jax

    return zaya_jax.load_config(args.config, overrides=[f"train.batch_size={args.batch}", *args.set])


def _ids(cfg, args) -> np.ndarray:
    return np.random.default_rng(0).integers(3, cfg.model.vocab_size, size=(args.batch, args.seq + 1))


# ---------------------------------------------------------------------------------------------
# Workers: set up, print READY, then answer "RUN n" with n step times until "QUIT".


def _serve(run, info: dict) -> None:
    """Answer each "RUN n" with the n step times, the minor page faults and kernel seconds per step
    and the process's peak resident set so far."""
    import resource

    from zaya_jax.allocator import loaded_allocator

    info["allocator"] = loaded_allocator() or "system"
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "QUIT":
            return
        times, steps = [], int(command[1])
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(steps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        usage = {
            "times": times,
            "faults": (after.ru_minflt - before.ru_minflt) / steps,
            "kernel_s": (after.ru_stime - before.ru_stime) / steps,
            "peak_rss_mb": after.ru_maxrss / 1024,
        }
        print("TIMES " + json.dumps(usage), flush=True)


def hf_worker(args) -> None:
    import torch
    import transformers

    from zaya_jax.interop.hf import model_to_hf_config

    cfg = _config(args)
    on_gpu = torch.cuda.is_available() and args.device == "gpu"
    device = "cuda" if on_gpu else "cpu"
    torch.manual_seed(0)
    model = transformers.ZayaForCausalLM(transformers.ZayaConfig(**model_to_hf_config(cfg.model)))
    model = model.train().to(device)
    if not Path(args.weights).exists():  # the first HF worker writes the weights every worker loads
        np.savez(args.weights, **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
    try:
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.optim.adam_lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
        )
    except (RuntimeError, TypeError):  # no fused AdamW for this device in this PyTorch
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.adam_lr, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.as_tensor(_ids(cfg, args), device=device)

    def run():
        # HF consumes seq + 1 ids and scores seq positions, as zaya-jax's inputs/targets split.
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        run()
    _serve(run, {"device": device, "threads": torch.get_num_threads(), "torch": torch.__version__})


def zaya_worker(args, variant: str) -> None:
    import jax
    import jax.numpy as jnp

    import zaya_jax
    from zaya_jax.interop.hf import hf_to_variables
    from zaya_jax.objectives import build_programs
    from zaya_jax.optim import LeafGroup, model_param_groups
    from zaya_jax.programs import init_train_state
    from zaya_jax.train.flops import flops_per_token, measured_cpu_peak, peak_flops

    cfg = _config(args)
    impl = variant.rsplit("_", 1)[-1]
    if variant == "dense_muon":
        model = dataclasses.replace(cfg.model, num_experts=1)
        cfg = dataclasses.replace(cfg, model=model)
        variables = zaya_jax.model.init_variables(model, 0)
    else:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_impl=impl))
        with np.load(args.weights) as weights:
            variables = jax.tree.map(jnp.asarray, hf_to_variables(dict(weights), cfg.model))
    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    if variant.startswith("zaya_adamw"):
        groups = jax.tree.map(
            lambda g: LeafGroup("adamw", None, g.decay), groups, is_leaf=lambda x: isinstance(x, LeafGroup)
        )
    # the program `zaya train` runs (loss guard included), on one device
    programs = build_programs(cfg, devices=jax.devices()[:1], groups=groups)
    ids = _ids(cfg, args)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ones = np.ones_like(inputs)
    batch = {
        "inputs": jnp.asarray(inputs, jnp.int32),
        "targets": jnp.asarray(targets, jnp.int32),
        "segment_ids": jnp.asarray(ones, jnp.int32),
        "positions": jnp.asarray(np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape), jnp.int32),
        "loss_mask": jnp.asarray(ones, jnp.float32),
    }
    box = [init_train_state(variables, programs.tx)]

    def run():
        box[0], metrics = programs.train_step(*programs.step_arguments(box[0], batch))
        jax.block_until_ready(metrics["loss"])

    for _ in range(args.warmup):
        run()
    on_gpu = jax.default_backend() == "gpu"
    info = {
        "backend": jax.devices()[0].device_kind,
        "flops_per_token": flops_per_token(cfg.model, args.seq),
        "peak": peak_flops(cfg.model.dtype)[0] if on_gpu else measured_cpu_peak(),
        "peak_source": "datasheet" if on_gpu else "measured float32 matmul",
    }
    _serve(run, info)


# ---------------------------------------------------------------------------------------------
# The driver


def _start(variant: str, args, weights: Path) -> subprocess.Popen:
    tree = None
    if variant.startswith(BASELINE):  # the same worker code, importing zaya_jax from another checkout
        variant, tree = variant[len(BASELINE) :], args.baseline
    variant, _, allocator = variant.partition("@")
    if not allocator:  # zaya workers: the allocator the zaya command runs under; HF: the C library's
        allocator = "auto" if variant.startswith(("zaya", "dense")) else "system"
    cmd = [sys.executable, __file__, "--worker", variant, "--weights", str(weights)]
    for name in ("config", "batch", "seq", "warmup", "device"):
        cmd += [f"--{name}", str(getattr(args, name))]
    if args.set:
        cmd += ["--set", *args.set]
    # Several processes share one GPU: no JAX worker may preallocate most of its memory.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ, "PYTHONUNBUFFERED": "1"}
    if tree:
        env["PYTHONPATH"] = str(Path(tree).resolve())
    env = _under(env, allocator)
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _under(env: dict[str, str], name: str) -> dict[str, str]:
    """``env`` for a worker under allocator ``name``: auto (what the zaya command picks), system,
    tcmalloc, mimalloc (with zaya's options) or mimalloc-purge (mimalloc purging freed memory after
    its default 10 ms)."""
    env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    if name == "system":
        return env
    library = {"auto": wanted_library, "tcmalloc": find_tcmalloc}.get(name, find_mimalloc)()
    if library is None:
        raise SystemExit(f"--allocators {name}: not installed here")
    env = allocator_env(env, library)
    if name == "mimalloc-purge":
        env["MIMALLOC_PURGE_DELAY"] = "10"
    return env


BASELINE = "baseline:"


def _expect(proc: subprocess.Popen, tag: str, variant: str):
    for line in proc.stdout:
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1 :])
    raise RuntimeError(f"worker {variant} exited with {proc.wait()} before {tag}")


def faults_vs_system(faults: dict[str, int]) -> dict[str, float]:
    """How many times fewer page faults per step each variant took than the same variant under the C
    library's malloc (``<variant>@system``; ``hf_adamw`` for HF), where that ran too."""
    system = {v.partition("@")[0]: f for v, f in faults.items() if v.endswith("@system") or v == "hf_adamw"}
    return {
        v: round(system[v.partition("@")[0]] / max(f, 1), 1)
        for v, f in faults.items()
        if v.partition("@")[0] in system and not v.endswith("@system") and v != "hf_adamw"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128, help="tokens per row that enter the loss")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all variants in turn")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["sorted"], help="zaya-jax MoE paths")
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"], choices=["adamw", "muon"])
    parser.add_argument("--no-dense", action="store_true", help="skip the dense model of equal active size")
    parser.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu"], help="PyTorch device")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.dtype=float32")
    parser.add_argument(
        "--baseline",
        help="another checkout of zaya-jax (e.g. a git worktree of the previous commit): its zaya "
        "variants run too, in their own processes, and each is compared with this tree's",
    )
    parser.add_argument("--no-hf", action="store_true", help="zaya variants only (with --baseline)")
    parser.add_argument(
        "--allocators",
        nargs="+",
        default=["auto"],
        choices=["auto", "system", "tcmalloc", "mimalloc", "mimalloc-purge"],
        help="run each zaya variant under each (auto: the zaya command's choice), and HF under "
        "each of system/tcmalloc/mimalloc given",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.worker.startswith("hf_adamw"):
        return hf_worker(args)
    if args.worker:
        return zaya_worker(args, args.worker)

    if _config(args).model.dtype != "float32":
        parser.error("HF runs in float32 here; compare like with like: --set model.dtype=float32")
    if args.device == "auto":
        args.device = "gpu"  # PyTorch on the GPU when it sees one, as JAX
    variants = ["hf_adamw"] + (["hf_adamw@tcmalloc"] if find_tcmalloc() and not args.no_hf else [])
    if "mimalloc" in args.allocators and not args.no_hf:
        variants.append("hf_adamw@mimalloc")
    ours = [f"zaya_{opt}_{impl}" for impl in args.impls for opt in args.optimizers]
    ours += [] if args.no_dense else ["dense_muon"]
    variants += ours if args.allocators == ["auto"] else [f"{v}@{a}" for v in ours for a in args.allocators]
    if args.baseline:
        variants += [BASELINE + v for v in variants if not v.startswith("hf_adamw")]
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights.npz"
        workers = {"hf_adamw": _start("hf_adamw", args, weights)}  # writes the weights first
        info = {"hf_adamw": _expect(workers["hf_adamw"], "READY", "hf_adamw")}
        if args.no_hf:
            workers.pop("hf_adamw").communicate("QUIT\n", timeout=60)
            variants.remove("hf_adamw")
        for variant in [v for v in variants if v not in workers]:  # set up (compile) one at a time
            workers[variant] = _start(variant, args, weights)
            info[variant] = _expect(workers[variant], "READY", variant)
        rounds, usage = {v: [] for v in variants}, {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant, proc in workers.items():
                proc.stdin.write(f"RUN {args.steps}\n")
                proc.stdin.flush()
                usage[variant].append(_expect(proc, "TIMES", variant))
                rounds[variant].append(statistics.median(usage[variant][-1]["times"]))
        for proc in workers.values():
            proc.stdin.write("QUIT\n")
            proc.stdin.flush()
            proc.wait(timeout=60)

    step_s = {v: statistics.median(r) for v, r in rounds.items()}
    tokens = args.batch * args.seq
    zaya = next(v for v in variants if not v.startswith("hf_adamw"))
    peak = info[zaya]["peak"]
    moe_flops = info[zaya]["flops_per_token"]
    faults = {v: round(statistics.median(u["faults"] for u in us)) for v, us in usage.items()}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus; jax on "
        f"{info[zaya]['backend']}, torch {info['hf_adamw']['torch']} on {info['hf_adamw']['device']} "
        f"({info['hf_adamw']['threads']} threads); one process per variant, run in turn",
        "shape": {"config": args.config, "batch": args.batch, "seq": args.seq, "set": args.set},
        "allocator": {v: info[v]["allocator"] for v in variants},
        "peak_gflops": round(peak / 1e9, 1),
        "peak_source": info[zaya]["peak_source"],
        "step_s": {v: round(t, 4) for v, t in step_s.items()},
        # per step, the median over rounds: minor page faults and kernel (system) ms, both cores
        "page_faults_per_step": faults,
        "page_faults_vs_system": faults_vs_system(faults),
        "kernel_ms_per_step": {
            v: round(1e3 * statistics.median(u["kernel_s"] for u in us), 1) for v, us in usage.items()
        },
        "peak_rss_mb": {v: round(max(u["peak_rss_mb"] for u in us)) for v, us in usage.items()},
        "round_medians_s": {v: [round(t, 4) for t in r] for v, r in rounds.items()},
        "tokens_per_s": {v: round(tokens / t) for v, t in step_s.items()},
        "mfu": {
            v: round(tokens * info.get(v, info[zaya]).get("flops_per_token", moe_flops) / t / peak, 4)
            for v, t in step_s.items()
        },
    }
    for hf in ("hf_adamw", "hf_adamw@tcmalloc", "hf_adamw@mimalloc"):
        if hf in step_s:
            key = "ratio_vs_hf" + hf[len("hf_adamw") :].replace("@", "_")
            report[key] = {v: round(step_s[hf] / t, 3) for v, t in step_s.items()}
    if args.baseline:  # < 1: this tree's step is faster than the baseline's
        report["time_vs_baseline"] = {
            v: round(step_s[v] / step_s[BASELINE + v], 3) for v in variants if BASELINE + v in step_s
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
