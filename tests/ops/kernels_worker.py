"""Run with 8 fake CPU devices and --xla_allow_excess_precision=false: bfloat16 kernels against the
reference (every bf16 op rounded, as the kernels do), the fused norm under shard_map (no gather of
the rows), and the model's forward and gradients on a data-parallel layout with the kernels on.
Prints one JSON line."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tests.ops.kernel_cases import _inputs, _rel
from tests.random_model import random_variables, tiny_config
from zaya_jax import ops
from zaya_jax.config import Config, MeshConfig
from zaya_jax.model import Zaya
from zaya_jax.parallel import make_layout


def bf16_errors():
    out = {}
    for shape in [(2, 9, 64), (7, 33), (1, 1, 1, 130)]:
        f, h, params = _inputs(shape, jnp.bfloat16)

        def loss(impl):
            def fn(f_, h_, *p):
                h_new, y = ops.residual_rms_norm(f_, h_, *p, eps=1e-5, impl=impl)
                y = y.astype(jnp.float32)
                return jnp.sum(jnp.sin(h_new)) + jnp.sum(y * jnp.cos(y))

            return jax.jit(jax.grad(fn, argnums=tuple(range(7))))

        fwd = jax.jit(lambda f, h, *p: ops.residual_rms_norm(f, h, *p, eps=1e-5))(f, h, *params)
        ref = ops.residual_rms_norm(f, h, *params, eps=1e-5, impl="reference")
        grads = loss("custom")(f, h, *params)
        ref_grads = loss("reference")(f, h, *params)
        out[str(shape)] = {
            "forward": max(_rel(a, b) for a, b in zip(fwd, ref, strict=True)),
            "gradients": max(_rel(a, b) for a, b in zip(grads, ref_grads, strict=True)),
        }
    return out


def sharded():
    mesh = jax.make_mesh((4, 2), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows = PartitionSpec("data", "context", None)
    f, h, params = _inputs((8, 6, 32), jnp.float32)
    f, h = (jax.device_put(x, NamedSharding(mesh, rows)) for x in (f, h))
    fn = ops.sharded_residual_rms_norm(mesh, rows)

    def loss(f, h, *p):
        h_new, y = fn(f, h, *p, eps=1e-5)
        return jnp.sum(h_new**2) + jnp.sum(jnp.sin(y)), (h_new, y)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(7)), has_aux=True))
    text = grad.lower(f, h, *params).compile().as_text()
    grads, outs = grad(f, h, *params)
    ref_grads, ref_outs = jax.grad(
        lambda f, h, *p: (lambda o: (jnp.sum(o[0] ** 2) + jnp.sum(jnp.sin(o[1])), o))(
            ops.residual_rms_norm(f, h, *p, eps=1e-5, impl="reference")
        ),
        argnums=tuple(range(7)),
        has_aux=True,
    )(np.asarray(f), np.asarray(h), *params)
    return {
        "outputs": max(_rel(a, b) for a, b in zip(outs, ref_outs, strict=True)),
        "gradients": max(_rel(a, b) for a, b in zip(grads, ref_grads, strict=True)),
        "all_gathers": text.count("all-gather-start") + text.count(" all-gather("),
        "custom_calls": text.count("zaya_residual_rms_norm"),
        "out_sharding": str(outs[1].sharding.spec),
    }


def model_on_layout():
    base = tiny_config()
    variables = random_variables(base, seed=5)
    tokens = jax.random.randint(jax.random.key(6), (8, 16), 0, base.vocab_size)
    results = {}
    for kernels in ("auto", "kernel"):  # on 8 devices they differ in the fused norm only
        cfg = Config(model=dataclasses.replace(base, kernels=kernels), mesh=MeshConfig(data=8))
        layout = make_layout(cfg)
        model = Zaya(cfg.model, layout.hooks)

        def loss(params, model=model):
            logits, _ = model.apply({**variables, "params": params}, tokens)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

        batch = jax.device_put(tokens, layout.batch)
        del batch
        results[kernels] = jax.jit(jax.value_and_grad(loss))(variables["params"])
    assert layout.kernels.norm == "kernel"
    (l_c, g_c), (l_r, g_r) = results["kernel"], results["auto"]
    return {
        "loss": abs(float(l_c) - float(l_r)),
        "gradients": max(_rel(a, b) for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_r), strict=True)),
    }


def distributed_muon():
    """Newton-Schulz as the CPU custom call inside distributed Muon's shard_map (fsdp=4 x expert=2),
    against XLA's loop, both in the standard formulation."""
    from zaya_jax.optim.muon import orthogonalize, orthogonalize_sharded

    mesh = jax.make_mesh((4, 2), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, PartitionSpec("expert", "fsdp", None))
    x = jax.random.normal(jax.random.key(0), (4, 32, 48))
    fn = jax.jit(lambda x: orthogonalize_sharded(x, (1, 2), sharding, impl="kernel", formulation="standard"))
    xs = jax.device_put(x, sharding)
    out = fn(xs)
    return {
        "error": _rel(out, orthogonalize(x, (1, 2), formulation="standard")),
        "custom_calls": fn.lower(xs).compile().as_text().count("zaya_newton_schulz"),
        "sharding": str(out.sharding.spec),
    }


def main():
    report = {
        "bf16": bf16_errors(),
        "sharded": sharded(),
        "model": model_on_layout(),
        "muon": distributed_muon(),
    }
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
