"""Custom calls inside ``shard_map``: an XLA FFI call's results carry no varying-manual-axes type,
where the pure-JAX computation they replace would; :func:`typed_like_reference` gives them the
reference's types, so that a custom call and its reference are interchangeable branches."""

from __future__ import annotations

import jax


def _vma(x) -> frozenset:
    return frozenset(jax.typeof(x).mat.varying)


def typed_like_reference(kernel, like=None):
    """Give the custom call's results the varying-axes types the reference's results have inside
    ``shard_map`` (a custom call's results carry none): varying over every axis its inputs vary
    over; where ``like`` names the primal input a result is the cotangent of, summed (``psum``) over
    the axes that input is invariant on (a replicated parameter's gradient is the sum of the
    devices' parts, as autodiff of the reference gives)."""

    def call(*args):
        axes = frozenset().union(*(_vma(a) for a in args))
        outs = kernel(*args)
        targets = [axes] * len(outs) if like is None else [_vma(args[i]) for i in like]
        typed = []
        for x, target in zip(outs, targets, strict=True):
            missing = tuple(sorted(axes - _vma(x)))
            x = jax.lax.pcast(x, missing, to="varying") if missing else x
            extra = tuple(sorted(axes - target))
            typed.append(jax.lax.psum(x, extra) if extra else x)
        return tuple(typed)

    return call
