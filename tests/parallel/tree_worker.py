"""Run with 8 fake CPU devices: greedy generation with the decode cache split over 8 devices (tree
attention) against one device; prints one JSON line with the tokens and the collectives per step."""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh

from tests.random_model import random_variables, tiny_config
from zaya_jax.generate import _generate_fn, generate


def main():
    cfg = tiny_config(layer_types=("hybrid", "hybrid_sliding"), sliding_window=4)
    variables = random_variables(cfg)
    params = jax.tree_util.tree_map_with_path(  # zero the residual biases: otherwise one token repeats
        lambda path, x: (
            x * 0 if "bias" in jax.tree_util.keystr(path) and "scale" in jax.tree_util.keystr(path) else x
        ),
        variables["params"],
    )
    variables = {**variables, "params": {**params, "input_bias": params["input_bias"] * 0}}
    prompts = [[5, 9, 14, 3, 22, 7], [7, 8, 9]]
    single = generate(cfg, variables, prompts, max_new_tokens=10, stop_tokens=[])
    mesh = Mesh(np.asarray(jax.devices()), ("context",))
    tree = generate(cfg, variables, prompts, max_new_tokens=10, stop_tokens=[], mesh=mesh)
    fn = _generate_fn(cfg, 10, True, 0, (), mesh)
    ids = np.asarray([[5, 9, 14, 3, 22, 7], [0, 0, 0, 7, 8, 9]], np.int32)
    mask = (ids > 0).astype(np.int32)
    args = (variables, ids, mask, jax.random.key(0), np.float32(1), np.float32(1), np.int32(61), np.int32(0))
    hlo = fn.lower(*args).compile().as_text()
    print(
        "RESULT "
        + json.dumps(
            {
                "single": single.tokens.tolist(),
                "tree": tree.tokens.tolist(),
                "all_reduce": hlo.count(" all-reduce(") + hlo.count(" all-reduce-start("),
                "all_gather": hlo.count(" all-gather(") + hlo.count(" all-gather-start("),
                "collective_permute": hlo.count(" collective-permute("),
                "devices": jax.device_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
