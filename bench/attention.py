"""CCA attention, forward + backward: the blocked (flash-style) kernel against the dense definition
(and, on a GPU, the fused Pallas kernel and ``jax.nn.dot_product_attention``, cuDNN where
available: with the document mask as a dense bias, and causal-only through ``attention_impl:
cudnn``, a lighter mask than the others compute), per shape. ``--pallas`` adds the Pallas kernel
on CPU too (interpret mode: a plumbing check, not a speed).

Every variant is a jitted ``grad`` of ``sum(w * attention(q, k, v))`` with two packed documents per
row (causal + document masks), timed alternately with the others (median of ``--repeats``), and
its planned temporary memory read from ``compiled.memory_analysis()``. Prints one JSON object:
times, temporaries and the ratio of each variant to ``dense``.

    python bench/attention.py [--shapes 16x128 4x512 1x2048 1x8192] [--blocks 128 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops.attention import attention, self_attention_mask

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # the `tiny` preset's attention


def make_inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), dtype)
    w = jnp.asarray(rng.standard_normal((batch, seq, heads * head_dim)), dtype)
    segments = np.ones((batch, seq), np.int32)
    segments[:, seq // 3 :] = 2
    return q, k, v, w, jnp.asarray(segments)


def variants(blocks: list[int], on_gpu: bool, pallas: bool = False) -> dict:
    out = {"dense": {"impl": "dense"}}
    for block in blocks:
        out[f"blocked_{block}"] = {"impl": "blocked", "block": block}
    if on_gpu or pallas:
        for block in sorted({min(b, 128) for b in blocks}):
            out[f"pallas_{block}"] = {"impl": "pallas", "block": block}
    if on_gpu:
        out["jax_nn_cudnn"] = {"impl": "cudnn_dense_mask"}
        out["cudnn_causal_only"] = {"impl": "cudnn", "causal_only": True}
    return out


def gradient_fn(spec: dict, segments: jax.Array, seq: int):
    mask = self_attention_mask(seq, None if spec.get("causal_only") else segments)

    def loss(q, k, v, w):
        if spec["impl"] == "cudnn_dense_mask":
            # Document masks only as a dense (seq, seq) bias for the library call.
            dense = mask.dense()[:, None]
            out = jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn")
            out = out.reshape(*q.shape[:2], -1)
        else:
            out = attention(q, k, v, mask, impl=spec["impl"], block=spec.get("block", 128))
        return jnp.sum(w * out.astype(w.dtype))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["16x128", "4x512", "1x2048", "1x8192"])
    parser.add_argument("--blocks", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--heads", default=f"{HEADS},{KV_HEADS},{HEAD_DIM}", help="nq,nk,d")
    parser.add_argument("--max-dense-seq", type=int, default=8192, help="skip dense above this length")
    parser.add_argument(
        "--pallas", action="store_true", help="also the Pallas kernel on CPU (interpret mode)"
    )
    args = parser.parse_args()
    nq, nk, d = (int(x) for x in args.heads.split(","))
    on_gpu = jax.default_backend() == "gpu"
    report = {"backend": jax.default_backend(), "heads": [nq, nk, d], "dtype": args.dtype, "shapes": {}}
    for shape in args.shapes:
        batch, seq = (int(x) for x in shape.split("x"))
        q, k, v, w, segments = make_inputs(batch, seq, nq, nk, d, jnp.dtype(args.dtype))
        runs, temps = {}, {}
        for name, spec in variants(args.blocks, on_gpu, args.pallas).items():
            if spec["impl"] == "dense" and seq > args.max_dense_seq:
                continue
            fn = gradient_fn(spec, segments, seq)
            try:
                compiled = fn.lower(q, k, v, w).compile()
            except Exception as err:  # a library kernel unavailable on this platform
                report.setdefault("skipped", {})[f"{shape}/{name}"] = str(err).splitlines()[0][:200]
                continue
            memory = compiled.memory_analysis()
            temps[name] = int(memory.temp_size_in_bytes) if memory is not None else None
            jax.block_until_ready(compiled(q, k, v, w))
            runs[name] = compiled
        times = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, compiled in runs.items():
                start = time.perf_counter()
                jax.block_until_ready(compiled(q, k, v, w))
                times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(t) for name, t in times.items()}
        reference = median.get("dense")
        report["shapes"][shape] = {
            "median_s": {name: round(t, 5) for name, t in median.items()},
            "temp_mib": {name: None if t is None else round(t / 2**20, 1) for name, t in temps.items()},
            "ratio_vs_dense": {name: round(t / reference, 3) for name, t in median.items()}
            if reference
            else None,
        }
        print(json.dumps({shape: report["shapes"][shape]}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
