"""Run in a subprocess with 8 fake CPU devices: a LoRA run (adapters on the experts and CCA's
projections, the base frozen) trained for a few steps on fixed batches under each mesh layout;
prints, as JSON, each layout's per-step losses and gradient norms, its final adapters' largest
difference from the single-device run's, how many adapter leaves it splits, and whether its base
is bit for bit the one it started from."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from tests.parallel.layouts_worker import MODEL, batches
from zaya_jax.model.lowrank import adapter_part, base_part
from zaya_jax.objectives import build_programs
from zaya_jax.parallel import put_batch

LORA = [
    "lora.rank=2",
    "balancing.enabled=false",
    "train.init_from=unused-by-this-worker",
    "optim.adam_lr=3e-3",
    "optim.warmup_steps=0",
]
LAYOUTS = {
    "single": ["mesh.data=1"],
    "expert2": ["mesh.data=4", "mesh.expert=2"],
    "fsdp_expert": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
    "zero1_expert": ["mesh.data=4", "mesh.expert=2", "mesh.optimizer_sharding=zero1"],
    "context_micro": ["mesh.data=2", "mesh.context=4", "train.micro_batches=2"],
}
STEPS = 6


def run(name: str, extra: list[str]) -> tuple[dict, dict]:
    cfg = zaya_jax.load_config("tiny", overrides=[*MODEL, *LORA, "train.steps=100", *extra])
    devices = jax.devices()[:1] if name == "single" else jax.devices()
    programs = build_programs(cfg, devices=devices)
    state = programs.init_state()
    # a trained-like CCA temperature: at 0 (a fresh init) q and k get no gradient at all
    temp = state.params["layers"]["attn"]["temp"]
    state = state.replace(
        params={**state.params, "layers": {**state.params["layers"], "attn": {
            **state.params["layers"]["attn"], "temp": jax.device_put(jnp.full_like(temp, 0.5), temp.sharding)
        }}}
    )  # fmt: skip
    base = jax.tree.map(np.asarray, base_part(state.params))
    compiled = programs.lower_train_step().compile()
    trace = {"losses": [], "grad_norms": []}
    for batch in batches(cfg, STEPS):
        state, metrics = compiled(*programs.step_arguments(state, put_batch(batch, programs.layout.batch)))
        trace["losses"].append(float(metrics["loss"]))
        trace["grad_norms"].append(float(metrics["grad_norm"]))
    adapters = jax.tree.map(np.asarray, adapter_part(state.params))
    trace["base_unchanged"] = all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(base_part(state.params)), strict=True)
    )
    trace["adapters_split"] = sum(
        not x.is_fully_replicated for x in jax.tree.leaves(adapter_part(state.params))
    )
    trace["opt_state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    trace["adapter_bytes"] = sum(x.nbytes for x in jax.tree.leaves(adapters) if x.ndim > 1)
    return trace, adapters


def main() -> None:
    results, reference = {}, None
    for name, extra in LAYOUTS.items():
        trace, adapters = run(name, extra)
        reference = adapters if reference is None else reference
        trace["adapter_error"] = max(
            float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
            for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(reference), strict=True)
        )
        results[name] = trace
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
