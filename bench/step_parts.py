"""Where a train step's time goes: the forward pass alone, forward and backward, and the whole
train step as ``zaya train`` runs it (clipping, Muon/AdamW, the balancing controller and the loss
guard added), in one process, interleaved, for the ``--config`` preset at ``--batch`` × ``--seq``
(``--set``: config overrides). All three run the paths the train step resolves ``auto`` to.

Run it under the allocator the ``zaya`` command uses: ``env $(python -m zaya_jax.allocator --env)
python bench/step_parts.py``. Prints one JSON object of median milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zaya_jax
from zaya_jax.model import Zaya
from zaya_jax.objectives import build_programs
from zaya_jax.optim import model_param_groups
from zaya_jax.programs import init_train_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--set", nargs="*", default=[], help="config overrides, e.g. model.attention_impl=dense"
    )
    args = parser.parse_args()
    cfg = zaya_jax.load_config(args.config, overrides=[f"train.batch_size={args.batch}", *args.set])
    programs = build_programs(
        cfg, devices=jax.devices()[:1], groups=model_param_groups(cfg.model, cfg.optim.router_group)
    )
    model = programs.cfg.model  # moe_impl "auto" resolved as the train step runs it
    variables = zaya_jax.model.init_variables(model, 0)
    # the train step donates its state: the forward and backward get their own copies
    params = jax.tree.map(jnp.copy, variables["params"])
    others = {k: jax.tree.map(jnp.copy, v) for k, v in variables.items() if k != "params"}
    ids = np.random.default_rng(0).integers(3, model.vocab_size, size=(args.batch, args.seq + 1))
    inputs, targets = jnp.asarray(ids[:, :-1], jnp.int32), jnp.asarray(ids[:, 1:], jnp.int32)

    def loss(params):
        logits, _ = Zaya(model, programs.layout.hooks).apply(
            {"params": params, **others}, inputs
        )  # its kernels
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    forward, backward = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    ones = np.ones(inputs.shape)
    batch = {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": jnp.asarray(ones, jnp.int32),
        "positions": jnp.asarray(np.broadcast_to(np.arange(args.seq), inputs.shape), jnp.int32),
        "loss_mask": jnp.asarray(ones, jnp.float32),
    }
    box = [init_train_state(variables, programs.tx)]

    def step():
        box[0], metrics = programs.train_step(*programs.step_arguments(box[0], batch))
        jax.block_until_ready(metrics["loss"])

    parts = {
        "forward": lambda: jax.block_until_ready(forward(params)),
        "forward_backward": lambda: jax.block_until_ready(backward(params)),
        "train_step": step,
    }
    for run in parts.values():  # compile and warm up
        for _ in range(3):
            run()
    times = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, run in parts.items():
            ts = []
            for _ in range(args.steps):
                start = time.perf_counter()
                run()
                ts.append(time.perf_counter() - start)
            times[name].append(statistics.median(ts))
    ms = {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()}
    ms["optimizer_and_rest"] = round(ms["train_step"] - ms["forward_backward"], 1)
    paths = {"kernels": programs.layout.kernels.describe(), "moe_impl": model.moe_impl}
    print(json.dumps({"config": args.config, "batch": args.batch, "seq": args.seq, "set": args.set, **paths,
                      "median_ms": ms}))  # fmt: skip


if __name__ == "__main__":
    main()
