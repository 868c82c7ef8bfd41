"""Run with 4 fake CPU devices: the expert-parallel MoE with the ragged exchange (through the
emulated collective, which XLA:CPU can run) against the padded exchange, dropless and capped;
forward outputs, dropped tokens and gradients. Prints one JSON line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zaya_jax.config import MESH_AXES
from zaya_jax.parallel.expert import emulated_ragged_all_to_all, expert_dispatch


def moe_inputs(experts=8, hidden=16, ffn=8):
    keys = jax.random.split(jax.random.key(0), 5)
    m = jax.random.normal(keys[0], (8, 12, hidden))
    choice = jax.random.randint(keys[1], (8, 12), 0, experts + 1)  # the skip class included
    choice = choice.at[:2].set(3)  # a hot expert, so that a capacity actually drops tokens
    weight = jax.random.uniform(keys[2], (8, 12))
    wi = jax.random.normal(keys[3], (experts, hidden, 2 * ffn)) / hidden**0.5
    wo = jax.random.normal(keys[4], (experts, ffn, hidden)) / ffn**0.5
    return m, choice, weight, wi, wo


def run(mesh, exchange, capacity_factor, inputs):
    dispatch = expert_dispatch(mesh, capacity_factor, exchange)
    m, choice, weight, wi, wo = inputs

    def loss(m, wi, wo):
        out, dropped = dispatch(m, choice, weight, wi, wo, "silu")
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), (out, dropped)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, (out, dropped) = grad(m, wi, wo)
    return out, dropped, grads


def main():
    mesh = Mesh(np.asarray(jax.devices()).reshape(1, 1, 4, 1), MESH_AXES)
    inputs = moe_inputs()
    report = {}
    for factor in (0.0, 0.5):
        out_p, dropped_p, grads_p = run(mesh, "padded", factor, inputs)
        out_r, dropped_r, grads_r = run(mesh, "emulated", factor, inputs)
        report[str(factor)] = {
            "out": float(jnp.max(jnp.abs(out_r - out_p))),
            "out_scale": float(jnp.max(jnp.abs(out_p))),
            "dropped_padded": int(dropped_p.sum()),
            "dropped_ragged": int(dropped_r.sum()),
            "grads": [
                float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                for a, b in zip(grads_r, grads_p, strict=True)
            ],
        }
    # The real collective: XLA:CPU cannot compile it, but the program must lower to it.
    report["ragged_lowered"] = run_lowering(mesh, inputs)

    # The emulation has ragged_all_to_all's documented semantics (the docstring's example).
    def example(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return emulated_ragged_all_to_all(
            operand[0], output[0], input_offsets[0], send_sizes[0], output_offsets[0], recv_sizes[0],
            axis_name="expert",
        )[None]  # fmt: skip

    two = Mesh(np.asarray(jax.devices()[:2]), ("expert",))
    spec = jax.sharding.PartitionSpec("expert")
    args = [
        [[1, 2, 2], [3, 4, 0]],
        [[0, 0, 0, 0], [0, 0, 0, 0]],
        [[0, 1], [0, 1]],
        [[1, 2], [1, 1]],
        [[0, 0], [1, 2]],
        [[1, 1], [2, 1]],
    ]
    args = [jax.device_put(np.asarray(a, np.int32), jax.NamedSharding(two, spec)) for a in args]
    fn = jax.shard_map(example, mesh=two, in_specs=(spec,) * 6, out_specs=spec)
    report["example"] = np.asarray(jax.jit(fn)(*args)).tolist()
    report["probe"] = run_probes(mesh)
    print("RESULT " + json.dumps(report))


def run_probes(mesh):
    """The correctness probe of mesh.expert_exchange auto: the emulated ragged exchange passes; one
    that corrupts what it carries, and one that fails to run, fall back to padded, saying why."""
    import warnings

    from zaya_jax.parallel import expert

    def corrupt(operand, output, *args, axis_name):  # scales the token rows, not the expert ids
        scaled = operand * 1.5 if jnp.issubdtype(operand.dtype, jnp.floating) else operand
        return emulated_ragged_all_to_all(scaled, output, *args, axis_name=axis_name)

    def broken(*args, axis_name):
        raise RuntimeError("UNIMPLEMENTED: ragged all-to-all on this platform")

    expert.EXCHANGES.update(corrupt=corrupt, broken=broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probes = {
            name: list(expert.probed_exchange(mesh, name)) for name in ("emulated", "corrupt", "broken")
        }
    probes["warnings"] = [str(w.message) for w in caught]
    return probes


def run_lowering(mesh, inputs):
    dispatch = expert_dispatch(mesh, 0.0, "ragged")
    m, choice, weight, wi, wo = inputs
    text = jax.jit(lambda m: dispatch(m, choice, weight, wi, wo, "silu")[0]).lower(m).as_text()
    return text.count("ragged_all_to_all")


if __name__ == "__main__":
    main()
