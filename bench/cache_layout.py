"""The decode cache's part of one engine step, in four layouts (the experiment behind the engine's
missed HF goal, bench/RESULTS.md): write one new token per row into 4 layers' keys and values, then
attend over them. ``scan``: a stacked (layers, rows, positions, heads, dim) cache scanned over layers
(what the model does today); ``carry``: the stacked cache carried and updated in place; ``tuple``: one
array per layer; ``tuple-BHSD``: one array per layer in the attention's (rows, heads, positions, dim)
layout.

    python bench/cache_layout.py
"""

import time

import jax
import jax.numpy as jnp

L, B, S, H, D = 4, 64, 384, 2, 32  # layers, rows, positions, KV heads, head dim


def attn(q, k, v):  # q (B,H,D), k (B,S,H,D)
    s = jnp.einsum("bhd,bshd->bhs", q, k)
    p = jax.nn.softmax(s, -1)
    return jnp.einsum("bhs,bshd->bhd", p, v)


rows = jnp.arange(B)


def step_scan(cache, q, idx):
    def body(h, kv):
        k, v = kv
        k = k.at[rows, idx].set(h)
        v = v.at[rows, idx].set(h)
        return attn(h, k, v), (k, v)

    h, (k, v) = jax.lax.scan(body, q, cache, unroll=L)
    return (k, v), h


def step_carry(cache, q, idx):
    k, v = cache
    h = q
    for layer in range(L):
        k = k.at[layer, rows, idx].set(h)
        v = v.at[layer, rows, idx].set(h)
        h = attn(h, k[layer], v[layer])
    return (k, v), h


def step_tuple(cache, q, idx):
    ks, vs = list(cache[0]), list(cache[1])
    h = q
    for layer in range(L):
        ks[layer] = ks[layer].at[rows, idx].set(h)
        vs[layer] = vs[layer].at[rows, idx].set(h)
        h = attn(h, ks[layer], vs[layer])
    return (tuple(ks), tuple(vs)), h


def step_tlayout(cache, q, idx):  # per-layer tuple, (B,H,S,D) layout
    ks, vs = list(cache[0]), list(cache[1])
    h = q
    for layer in range(L):
        ks[layer] = ks[layer].at[rows, :, idx].set(h)
        vs[layer] = vs[layer].at[rows, :, idx].set(h)
        s = jnp.einsum("bhd,bhsd->bhs", h, ks[layer])
        p = jax.nn.softmax(s, -1)
        h = jnp.einsum("bhs,bhsd->bhd", p, vs[layer])
    return (tuple(ks), tuple(vs)), h


def main() -> None:
    q = jnp.ones((B, H, D))
    idx = jnp.full((B,), 5)
    for name, fn, cache in [
        ("scan", step_scan, (jnp.zeros((L, B, S, H, D)), jnp.zeros((L, B, S, H, D)))),
        ("carry", step_carry, (jnp.zeros((L, B, S, H, D)), jnp.zeros((L, B, S, H, D)))),
        (
            "tuple",
            step_tuple,
            (
                tuple(jnp.zeros((B, S, H, D)) for _ in range(L)),
                tuple(jnp.zeros((B, S, H, D)) for _ in range(L)),
            ),
        ),
        (
            "tuple-BHSD",
            step_tlayout,
            (
                tuple(jnp.zeros((B, H, S, D)) for _ in range(L)),
                tuple(jnp.zeros((B, H, S, D)) for _ in range(L)),
            ),
        ),
    ]:
        f = jax.jit(fn, donate_argnums=0)
        cache, h = f(cache, q, idx)
        jax.block_until_ready(h)
        t = time.perf_counter()
        for _ in range(30):
            cache, h = f(cache, q, idx)
        jax.block_until_ready(h)
        print(name, f"{(time.perf_counter() - t) / 30 * 1000:.2f} ms")


if __name__ == "__main__":
    main()
