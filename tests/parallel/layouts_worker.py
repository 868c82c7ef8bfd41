"""Run in a subprocess with 8 fake CPU devices: trains a few steps of a miniature model on fixed
batches under each mesh layout, with the balancing controller active, and prints, as JSON, each
layout's per-step losses, gradient norms, router-probability spreads and balancing biases, and its
first-step gradients' largest relative difference from the single-device run."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

import zaya_jax
from zaya_jax.loss import loss_and_stats
from zaya_jax.model import Zaya
from zaya_jax.objectives import build_programs
from zaya_jax.parallel import put_batch

MODEL = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.moe_intermediate_size=32",
    "model.router_hidden_size=8",
    "train.batch_size=8",
    "train.seq_len=16",
]
LAYOUTS = {
    "single": ["mesh.data=1"],
    "data": ["mesh.data=8"],
    "fsdp": ["mesh.data=1", "mesh.fsdp=8"],
    "expert": ["mesh.data=2", "mesh.expert=4"],
    "context": ["mesh.data=2", "mesh.context=4"],  # zig-zag, the default
    "context_contiguous": ["mesh.data=2", "mesh.context=4", "mesh.context_layout=contiguous"],
    "combined": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2"],
    "expert_capped": ["mesh.data=2", "mesh.expert=4", "mesh.expert_capacity_factor=0.5"],
    "zero1": ["mesh.data=8", "mesh.optimizer_sharding=zero1"],
    "zero1_expert_context": [
        "mesh.data=2",
        "mesh.expert=2",
        "mesh.context=2",
        "mesh.optimizer_sharding=zero1",
    ],
}
STEPS = 6
# Layouts whose first-step gradients are compared leaf by leaf (a second compiled program each, ~10 s
# of the CI's time): combined splits every axis at once (fsdp, expert's all_to_all, context's ring
# and halos). The others are compared step by step through losses, gradient norms, spreads and
# biases (data and ZeRO-1 replicate every parameter like the single device).
GRADIENT_LAYOUTS = ("single", "combined")


def batches(cfg, steps):
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    out = []
    for _ in range(steps):
        tokens = rng.integers(3, cfg.model.vocab_size, (shape[0], shape[1] + 1)).astype(np.int32)
        segments = np.ones(shape, np.int32)
        segments[:, shape[1] // 2 :] = 2  # two packed documents per row
        positions = np.concatenate([np.arange(shape[1] // 2)] * 2)[None].repeat(shape[0], 0).astype(np.int32)
        out.append(
            {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "segment_ids": segments,
                "positions": positions,
                "loss_mask": np.ones(shape, np.float32),
            }
        )
    return out


def run(extra, names):
    from tests.parallel.muon_worker import count_collectives  # it imports this module's MODEL

    cfg = zaya_jax.load_config("tiny", overrides=[*MODEL, "train.steps=100", *extra, *sys.argv[1:]])
    devices = jax.devices()[:1] if names == "single" else jax.devices()
    programs = build_programs(cfg, devices=devices)  # the programs `zaya train` runs
    layout, shardings = programs.layout, programs.shardings
    state = programs.init_state()

    lowered = programs.lower_train_step()  # as training compiles it: one trace, one compile
    compiled = lowered.compile()

    def step(state, batch):
        return compiled(*programs.step_arguments(state, batch))

    grads = None
    if names in GRADIENT_LAYOUTS:
        model = Zaya(cfg.model, layout.hooks)
        grad_fn = jax.jit(
            jax.grad(lambda p, b, batch: loss_and_stats(model, p, b, batch, 0.0)[0]),
            in_shardings=(shardings.params, shardings.balancing, layout.batch),
            out_shardings=shardings.params,
        )
        first = put_batch(batches(cfg, 1)[0], layout.batch)
        grads = jax.tree.map(np.asarray, grad_fn(state.params, state.balancing, first))
    trace = {"losses": [], "grad_norms": [], "spreads": [], "biases": []}
    dropped = 0.0
    for batch in batches(cfg, STEPS):
        state, metrics = step(state, put_batch(batch, layout.batch))
        trace["losses"].append(float(metrics["loss"]))
        trace["grad_norms"].append(float(metrics["grad_norm"]))
        trace["spreads"].append(float(metrics["router_prob_spread"]))
        trace["biases"].append(np.asarray(state.balancing["layers"]["router"]["biases"]).tolist())
        dropped += float(metrics["dropped_tokens"])
    sharded = sum(not x.is_fully_replicated for x in jax.tree.leaves(state.params))
    hlo = lowered.as_text()
    compiled_hlo = compiled.as_text()
    opt = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    collectives = {
        "all_to_all": hlo.count("all_to_all"),
        "collective_permute": hlo.count("collective_permute"),
        "all_gather": compiled_hlo.count("all-gather-start") + compiled_hlo.count(" all-gather("),
        # collectives inside while bodies (the layer scan, micro-batches, Newton-Schulz)
        "in_loops": count_collectives(compiled_hlo)["in_loops"],
        # bytes of optimizer state each device holds, over the bytes of the whole state
        "opt_share": sum(x.addressable_shards[0].data.nbytes for x in opt) / sum(x.nbytes for x in opt),
    }
    return trace, grads, sharded, dict(layout.mesh.shape), dropped, collectives


def main():
    results, reference = {}, None
    for name, extra in LAYOUTS.items():
        trace, grads, sharded, mesh, dropped, collectives = run(extra, name)
        if reference is None:
            reference = grads
        # Largest gradient error of any leaf, relative to that leaf's largest gradient.
        error = None
        if grads is not None:
            error = max(
                float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
            )
        results[name] = {
            **trace,
            "grad_error": error,
            "sharded": sharded,
            "mesh": mesh,
            "dropped": dropped,
            **collectives,
        }
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
