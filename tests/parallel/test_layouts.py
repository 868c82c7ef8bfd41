"""Every parallel layout on 8 fake CPU devices (data, fsdp, expert, context, and all combined)
reproduces the single-device gradients and losses; expert parallelism exchanges tokens with
all_to_all and, with a capped exchange, drops and reports tokens; context parallelism runs ring
attention with the CCA convolution and value halos.

Every step of a 6-step run is compared with the balancing controller active: losses, gradient
norms, the router-probability spread that sets the controller's gain, and the balancing biases it
writes, so a statistic that depends on the layout (as the spread once did, through float32
cancellation: 92% off on a data-parallel mesh) cannot hide behind a loose loss tolerance.

First-step gradients are compared leaf by leaf for the layouts of ``GRADIENT_LAYOUTS`` (the
combined layout, splitting fsdp, expert and context at once; the others step by step). Tolerances, with what was measured: gradients of the same
parameters on the same batch agree to 1e-5 of each leaf's largest entry (~1e-6, float32 summation
order); per-step losses to 1e-6 relative (2.6e-7); gradient norms to 1e-5 (8e-8); spreads to 1e-4
(2.9e-6); biases to 1e-9 absolute (1e-11; the controller moves them by ~1e-6 per step at
initialisation).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.parallel.layouts_worker import GRADIENT_LAYOUTS, LAYOUTS, STEPS
from tests.workers import run_worker


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.parallel.layouts_worker", 8, timeout=900)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("single", "expert_capped")])
def test_layout_matches_the_single_device_run(results, layout):
    single, got = results["single"], results[layout]
    assert (got["grad_error"] < 1e-5) if layout in GRADIENT_LAYOUTS else got["grad_error"] is None
    assert len(got["losses"]) == STEPS
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=1e-6)
    np.testing.assert_allclose(got["grad_norms"], single["grad_norms"], rtol=1e-5)
    np.testing.assert_allclose(got["spreads"], single["spreads"], rtol=1e-4)
    np.testing.assert_allclose(got["biases"], single["biases"], rtol=0, atol=1e-9)
    assert got["dropped"] == 0  # dropless, expert parallelism included


def test_the_controller_moves_the_biases_in_the_compared_run(results):
    # The comparison above is only meaningful if the controller acts: biases leave their init.
    biases = np.asarray(results["single"]["biases"])
    assert np.abs(biases[-1] - biases[0]).max() > 1e-7
    assert min(results["single"]["spreads"]) > 0


def test_expert_parallelism_exchanges_tokens_with_all_to_all(results):
    # Tokens go to their expert's device and come back: 3 all_to_all forward (rows, expert ids,
    # results), 2 in the backward pass; layouts without an expert axis exchange none.
    assert results["expert"]["all_to_all"] == results["combined"]["all_to_all"] == 5
    assert results["data"]["all_to_all"] == results["fsdp"]["all_to_all"] == 0


def test_context_parallelism_passes_blocks_and_halos_around_the_ring(results):
    # Ring attention (K/V, key segment ids and padding mask) and the conv/value halos are
    # collective_permutes inside the layer scan; layouts without a context axis have none.
    # (more ring steps on the 4-way context axis than on the combined layout's 2-way one)
    assert results["context"]["collective_permute"] > results["combined"]["collective_permute"] >= 4
    assert results["data"]["collective_permute"] == results["expert"]["collective_permute"] == 0


def test_a_capped_expert_exchange_drops_and_reports_tokens(results):
    capped = results["expert_capped"]
    assert capped["dropped"] > 0
    assert np.isfinite(capped["losses"]).all()


def test_layouts_really_shard(results):
    assert results["single"]["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "context": 1}
    assert results["expert"]["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "context": 1}
    assert results["data"]["sharded"] == 0  # pure data parallelism replicates every parameter
    assert results["expert"]["sharded"] == 2  # wi and wo split over the expert axis
    assert results["fsdp"]["sharded"] >= 20  # every weight with a residual-width axis
    assert results["combined"]["sharded"] == results["fsdp"]["sharded"]


def test_zero1_splits_the_optimizer_state_over_data_and_gathers_the_parameters(results):
    # ZeRO-1 on data=8: each device holds an eighth of the optimizer state (a plain data layout
    # holds all of it), the parameters stay replicated, and the step all-gathers the new ones.
    assert results["data"]["opt_share"] == 1.0
    assert 0.12 < results["zero1"]["opt_share"] < 0.13
    assert results["zero1"]["sharded"] == results["data"]["sharded"] == 0
    assert results["zero1"]["all_gather"] > results["data"]["all_gather"]
    # Distributed Muon on the shares: each device iterates on its own layers' whole matrices, so
    # the Newton-Schulz loop holds no collective (as in plain data parallelism).
    assert results["zero1"]["in_loops"] == results["data"]["in_loops"] == 0
    # Composed with expert and context parallelism (data=2): less than the expert layout alone.
    assert results["zero1_expert_context"]["opt_share"] < 0.5
