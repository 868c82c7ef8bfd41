"""LoRA on every mesh layout: one device, expert parallelism (the adapters split with their
experts), FSDP x expert, ZeRO-1 x expert and context parallelism with two micro-batches train the
same adapters step by step over 6 steps, and
no layout writes to the frozen base. Tolerances as tests/parallel/test_layouts.py's (measured:
losses 2.6e-7 relative, gradient norms 1.5e-7, final adapters 6.8e-6 of each leaf's largest entry
after 6 AdamW steps, which amplify float32 summation order)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.lora.lora_layouts_worker import LAYOUTS, STEPS
from tests.workers import run_worker


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.lora.lora_layouts_worker", 8, timeout=900)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_lora_on_a_layout_matches_one_device(results, layout):
    single, got = results["single"], results[layout]
    assert len(got["losses"]) == STEPS
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=1e-6)
    np.testing.assert_allclose(got["grad_norms"], single["grad_norms"], rtol=1e-5)
    assert got["adapter_error"] < 1e-4
    if "expert" in layout:
        assert got["adapters_split"] >= 4  # wi's and wo's A and B split over the expert axis
    assert got["base_unchanged"]


def test_the_frozen_base_has_no_optimizer_state(results):
    single = results["single"]
    assert single["base_unchanged"] and single["adapters_split"] == 0
    assert single["opt_state_bytes"] == 2 * single["adapter_bytes"]  # AdamW's two moments, adapters only
    assert single["grad_norms"][0] > 0
