"""Tree-attention decoding: with the decode cache split along its slots over 8 fake devices,
greedy generation (left padding and a sliding-window layer included) gives the single-device
tokens; the partial attentions are combined by all-reduces, not by passing K/V around a ring."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import Mesh

from tests.random_model import random_variables, tiny_config
from tests.workers import run_worker
from zaya_jax.generate import generate


@pytest.fixture(scope="module")
def result():
    return run_worker("tests.parallel.tree_worker", 8)


def test_sequence_split_cache_decodes_the_single_device_tokens(result):
    assert result["devices"] == 8
    assert result["tree"] == result["single"]
    assert len({t for row in result["single"] for t in row}) >= 3  # not one token repeated


def test_partials_are_combined_by_all_reduces(result):
    # prefill and the decode step each combine max, denominator and numerator with all-reduces
    assert 2 <= result["all_reduce"] <= 6
    assert result["collective_permute"] == 0  # no ring


def test_a_mesh_without_a_context_axis_is_refused():
    import jax

    cfg = tiny_config()
    with pytest.raises(ValueError, match="'context' axis"):
        generate(cfg, random_variables(cfg), [[4, 5]], mesh=Mesh(np.asarray(jax.devices()), ("data",)))
