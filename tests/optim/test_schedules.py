"""Learning-rate schedules hit their boundary values; the batch-size lr rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zaya_jax.optim import batch_lr_scale, learning_rate_schedule


def _values(schedule, steps: list[int]) -> list[float]:
    return [float(schedule(step)) for step in steps]


def test_wsd_warms_up_holds_then_decays_to_min():
    # 100 steps, 10 warmup, decay over the last 20 to 0.1 * peak.
    schedule = learning_rate_schedule("wsd", 2.0, 100, 10, 0.2, 0.1)
    got = _values(schedule, [0, 5, 10, 50, 80, 90, 100, 150])
    np.testing.assert_allclose(got, [0.0, 1.0, 2.0, 2.0, 2.0, 1.1, 0.2, 0.2], rtol=1e-6)


def test_wsd_without_decay_stays_at_peak():
    schedule = learning_rate_schedule("wsd", 1.0, 100, 0, 0.0, 0.0)
    np.testing.assert_allclose(_values(schedule, [0, 99, 100, 200]), [1.0] * 4)


def test_wsd_overlapping_warmup_and_decay_takes_the_lower_ramp():
    schedule = learning_rate_schedule("wsd", 1.0, 10, 8, 0.5, 0.0)  # decay starts at 5, warmup ends at 8
    np.testing.assert_allclose(_values(schedule, [4, 6, 7, 10]), [0.5, 0.75, 0.6, 0.0], atol=1e-6)


def test_cosine_endpoints_and_midpoint():
    schedule = learning_rate_schedule("cosine", 1.0, 110, 10, 0.0, 0.1)
    got = _values(schedule, [0, 5, 10, 60, 110, 200])
    np.testing.assert_allclose(got, [0.0, 0.5, 1.0, 0.55, 0.1, 0.1], rtol=1e-6, atol=1e-7)


def test_constant_is_warmup_then_peak():
    schedule = learning_rate_schedule("constant", 3e-3, 100, 4, 0.2, 0.0)
    np.testing.assert_allclose(_values(schedule, [0, 2, 4, 100]), [0.0, 1.5e-3, 3e-3, 3e-3], rtol=1e-6)


def test_bad_schedule_arguments_raise():
    with pytest.raises(ValueError, match="choose 'wsd', 'cosine' or 'constant'"):
        learning_rate_schedule("linear", 1.0, 10, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="decay_fraction"):
        learning_rate_schedule("wsd", 1.0, 10, 0, 1.5, 0.0)


def test_batch_lr_scale_rules():
    assert batch_lr_scale(64, 256, "none") == 1.0
    assert batch_lr_scale(64, 256, "sqrt") == 0.5
    assert batch_lr_scale(64, 256, "linear") == 0.25
    assert math.isclose(batch_lr_scale(512, 256, "sqrt"), math.sqrt(2))
    with pytest.raises(ValueError, match="'none', 'sqrt' or 'linear'"):
        batch_lr_scale(1, 1, "cubic")
