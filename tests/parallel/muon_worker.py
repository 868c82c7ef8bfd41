"""Run with 8 fake CPU devices: compiles the optimizer update for parameters laid out on a
fsdp=4 x expert=2 mesh, with and without the per-device Newton-Schulz, as the CPU program and as
the GPU program, counts the collectives (in total and inside while-loop bodies, where the GPU
program's NS iteration lives) and compares the updates with the single-device optimizer of the same
program. Prints one JSON line."""

from __future__ import annotations

import contextlib
import functools
import json
import re

import jax
import numpy as np

import zaya_jax
from tests.parallel.layouts_worker import MODEL
from zaya_jax.model import init_variables
from zaya_jax.ops.platform import planning_for
from zaya_jax.optim import build_optimizer, model_param_groups
from zaya_jax.parallel import make_layout, matching_shardings

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective instructions in the whole module and inside while bodies (transitively)."""
    computations, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            current = header.group(1)
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    calls = {
        name: set(
            re.findall(
                r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", "\n".join(lines)
            )
        )
        for name, lines in computations.items()
    }
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside, stack = set(), list(bodies)
    while stack:
        name = stack.pop()
        if name in inside or name not in computations:
            continue
        inside.add(name)
        stack.extend(calls.get(name, ()))

    def count(names):
        return sum(
            1
            for name in names
            for line in computations[name]
            if any(re.search(rf"= \S+ {op}(-start)?\(", line) for op in COLLECTIVES)
        )

    return {"total": count(computations), "in_loops": count(inside)}


def main():
    cfg = zaya_jax.load_config("tiny", overrides=[*MODEL, "mesh.data=1", "mesh.fsdp=4", "mesh.expert=2"])
    layout = make_layout(cfg)
    groups = model_param_groups(cfg.model, cfg.optim.router_group)
    params = init_variables(cfg.model, 0)["params"]
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
    reference_tx = build_optimizer(cfg.optim, groups, 100)
    state = reference_tx.init(params)
    for _ in range(3):  # move past warm-up so updates are non-zero
        _, state = reference_tx.update(grads, state, params)
    p_sh = layout.variables["params"]
    s_sh = matching_shardings(state, params, p_sh, layout.mesh)
    out = {}
    # The CPU program (Newton-Schulz as a custom call per leaf, no loop in the HLO) and the GPU
    # program traced on these CPU devices (planning_for): the JAX loop, where GSPMD unaided would
    # communicate in every iteration.
    for program, context in (("", contextlib.nullcontext), ("gpu_", functools.partial(planning_for, "gpu"))):
        with context():
            reference, _ = jax.jit(lambda *a: reference_tx.update(*a))(grads, state, params)
            for name, shardings in (("per_device_ns", p_sh), ("gspmd", None)):
                tx = build_optimizer(cfg.optim, groups, 100, shardings=shardings)
                update = jax.jit(tx.update, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh))
                args = (
                    jax.device_put(grads, p_sh),
                    jax.device_put(state, s_sh),
                    jax.device_put(params, p_sh),
                )
                compiled = update.lower(*args).compile()
                updates, _ = compiled(*args)
                error = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(reference), strict=True)
                )
                out[program + name] = {**count_collectives(compiled.as_text()), "max_error": error}
    muon_leaves = sum(
        g.group == "muon" for g in jax.tree.leaves(groups, is_leaf=lambda x: hasattr(x, "group"))
    )
    sharded_muon = sum(
        g.group == "muon" and not s.is_fully_replicated
        for g, s in zip(
            jax.tree.leaves(groups, is_leaf=lambda x: hasattr(x, "group")), jax.tree.leaves(p_sh), strict=True
        )
    )
    out["muon_leaves"], out["sharded_muon_leaves"] = muon_leaves, sharded_muon
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
