"""Run with 8 fake CPU devices: ring attention over a sequence split 8 ways against single-device
attention (causal, two packed documents, left padding, sliding window and not), forward and
gradients. Prints one JSON line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zaya_jax.ops.attention import dot_product_attention, self_attention_mask
from zaya_jax.parallel.ring import ring_attention


def main():
    mesh = Mesh(np.asarray(jax.devices()), ("context",))
    rng = np.random.default_rng(0)
    batch, seq, nq, nk, d = 2, 32, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, h, d)), jnp.float32) for h in (nq, nk, nk))
    segments = np.ones((batch, seq), np.int32)
    segments[0, 13:] = 2  # two documents in row 0, the boundary inside a device's block
    real = np.ones((batch, seq), np.int32)
    real[1, :5] = 0  # left padding in row 1
    segments, real = jnp.asarray(segments), jnp.asarray(real)
    out = {}
    for layout, window in [
        (layout, window) for layout in ("contiguous", "zigzag") for window in (None, 0, 6)
    ]:
        attend = ring_attention(mesh, layout=layout)
        w = None if window is None else jnp.int32(window)
        mask = self_attention_mask(seq, segments, real).replace(window=w).dense()

        def reference(q, k, v, mask=mask):
            return jnp.sum(jnp.sin(dot_product_attention(q, k, v, mask)))

        def ring(q, k, v, w=w, attend=attend):
            return jnp.sum(jnp.sin(attend(q, k, v, segments, real, w)))

        want = dot_product_attention(q, k, v, mask)
        got = jax.jit(lambda q, k, v, w=w, attend=attend: attend(q, k, v, segments, real, w))(q, k, v)
        g_want = jax.grad(reference, argnums=(0, 1, 2))(q, k, v)
        g_got = jax.jit(jax.grad(ring, argnums=(0, 1, 2)))(q, k, v)
        hlo = (
            jax.jit(lambda q, k, v, w=w, attend=attend: attend(q, k, v, segments, real, w))
            .lower(q, k, v)
            .compile()
            .as_text()
        )
        out[f"{layout},window={window}"] = {
            "forward": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),  # padding rows: 0 in both
            "grad": max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(g_got, g_want, strict=True)
            ),
            "collective_permute": hlo.count("collective-permute-start(") + hlo.count(" collective-permute("),
            "all_gather": hlo.count(" all-gather(") + hlo.count("all-gather-start("),
        }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
