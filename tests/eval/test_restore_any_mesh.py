"""A checkpoint saved from 8 devices with sharded parameters (each device writing its own shards)
restores, evaluates and generates on this single-device process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

import zaya_jax
from tests.fixtures import MINI
from zaya_jax.cli import main

SAVE_SHARDED = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import zaya_jax
    from zaya_jax import checkpoint
    from zaya_jax.model import init_variables

    run, overrides = sys.argv[1], sys.argv[2:]
    assert jax.device_count() == 8, jax.devices()
    cfg = zaya_jax.load_config("tiny", overrides=overrides)
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))

    def shard(x):  # split the first axis divisible by 4 over "model" and the next by 2 over "data"
        spec, free = [None] * x.ndim, ["model", "data"]
        for axis, size in enumerate(x.shape):
            if free and size % (4 if free[0] == "model" else 2) == 0:
                spec[axis] = free.pop(0)
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    variables = jax.tree.map(shard, init_variables(cfg.model, seed=7))
    sharded = [x for x in jax.tree.leaves(variables) if len(x.sharding.device_set) == 8 and not x.is_fully_replicated]
    assert len(sharded) > 10, len(sharded)
    checkpoint.save_model(run, cfg, variables, step=3)
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(variables)}
    np.savez(run + "/expected.npz", **flat)
    """
)


def test_a_checkpoint_sharded_over_8_devices_restores_on_one(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [o for o in MINI if o.startswith("model.")] + ["model.num_experts=4"]
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", SAVE_SHARDED, str(run), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert jax.device_count() == 1

    lm = zaya_jax.load(run)
    assert lm.step == 3
    expected = np.load(run / "expected.npz")
    restored = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(lm.variables)}
    assert sorted(restored) == sorted(expected.files)
    for name, value in restored.items():
        assert value.sharding.device_set == {jax.devices()[0]}, name
        np.testing.assert_array_equal(np.asarray(value), expected[name], err_msg=name)

    capsys.readouterr()
    assert main(["eval", str(run), "--seq-len", "32", "--batches", "1", "--batch-size", "2", "--json"]) == 0
    assert np.isfinite(json.loads(capsys.readouterr().out)["loss"])
    assert main(["inspect", str(run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 3
    assert lm.generate("def ", max_new_tokens=3, stop_tokens=[]).tokens.shape == (1, 3)
