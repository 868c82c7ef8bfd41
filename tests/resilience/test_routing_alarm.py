"""Routing health: a layer whose router sends every token to one expert raises one
``routing_alarm`` naming the layer and the statistic, and the configured action is taken (warn:
the run goes on; rollback: back to the last checkpoint, then a stop once rollbacks run out; skip:
each step undoes itself on its own statistics); the monitor's statistics on their own."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import zaya_jax
from tests.fixtures import MINI
from zaya_jax import checkpoint
from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.model import init_variables
from zaya_jax.resilience import RoutingMonitor

CHECKED = [
    "balancing.enabled=false",
    "resilience.routing_window=3",
    "resilience.routing_warmup=0",
    "--no-progress",
    "eval.every=100",
]


def _collapsed_model(tmp_path):
    """A MINI model saved with layer 1's balancing bias for expert 0 far above the others."""
    cfg = load_config("tiny", MINI)
    variables = init_variables(cfg.model, 0)
    biases = variables["balancing"]["layers"]["router"]["biases"]
    variables["balancing"]["layers"]["router"]["biases"] = biases.at[1, 0].set(50.0)
    checkpoint.save_model(tmp_path / "collapsed", cfg, variables)
    return tmp_path / "collapsed"


def _events(run, name):
    lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return [e["detail"] for e in lines if e["event"] == name]


def test_a_collapsed_layer_raises_the_alarm_and_the_action_is_taken(tmp_path, capsys):
    source = _collapsed_model(tmp_path)
    warned = tmp_path / "warned"
    args = ["train", *MINI, "--init-from", str(source), *CHECKED]
    assert main([*args, f"run.dir={warned}", "train.steps=6"]) == 0
    alarms = _events(warned, "routing_alarm")
    assert alarms == [
        {
            "at_step": 3,
            "layer": 1,
            "statistic": "load_ratio",
            "value": None,
            "limit": 50.0,
            "window": 3,
            "action": "warn",
        }
    ]  # raised once while it holds, not at every step
    err = capsys.readouterr().err
    assert "layer 1's routing is unhealthy: load_ratio" in err
    assert err.count("routing is unhealthy") == 1 and "invalid value" not in err  # one line, no numpy warning

    rolled = tmp_path / "rolled"
    rollback = [
        "resilience.on_routing_alarm=rollback",
        "resilience.max_rollbacks=1",
        "checkpoint.every_steps=2",
    ]
    assert main([*args, *rollback, f"run.dir={rolled}", "train.steps=6"]) == 1
    assert _events(rolled, "rollback") == [
        {"reason": "routing load_ratio in layer 1", "from_step": 3, "to_step": 2}
    ]
    assert [a["at_step"] for a in _events(rolled, "routing_alarm")] == [3, 5]  # the window refills
    assert "1 rollbacks already" in capsys.readouterr().err

    skipped = tmp_path / "skipped"  # skip: every step sees the collapse in its own batch and undoes itself
    assert main([*args, "resilience.on_routing_alarm=skip", f"run.dir={skipped}", "train.steps=6"]) == 0
    assert [(e["reason"], e["at_step"]) for e in _events(skipped, "skip")] == [
        ("routing", s) for s in range(1, 7)
    ]
    before, after = (zaya_jax.load(path).variables["params"] for path in (source, skipped))
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )


def test_the_monitor_judges_windowed_statistics():
    overrides = ["resilience.routing_window=2", "resilience.routing_warmup=1", "balancing.skip_target=0.1"]
    monitor = RoutingMonitor(load_config("tiny", overrides))
    layers, classes = 4, 5
    healthy = {
        "load": np.full((layers, classes), 0.2),
        "entropy": np.full(layers, 0.9),
        "pinned": np.zeros((layers, classes)),
    }
    collapsed = {**healthy, "entropy": np.zeros(layers)}
    assert monitor.add(1, collapsed) is None  # the warm-up: neither judged nor kept
    assert monitor.add(2, healthy) is None and monitor.add(3, healthy) is None
    flat = {**healthy, "entropy": jnp.asarray([0.9, 0.9, 0.001, 0.9])}
    assert monitor.add(4, flat) is None  # the window's mean (0.45) is still fine
    alarm = monitor.add(5, flat)
    assert (alarm.layer, alarm.statistic) == (2, "entropy") and alarm.value < 0.02
    assert monitor.add(6, flat) is None  # raised once while it holds
    pinned = {**healthy, "pinned": np.eye(layers, classes)}
    monitor.reset()
    monitor.add(7, pinned)
    assert monitor.add(8, pinned).statistic == "pinned_bias"
    skipping = {**healthy, "load": np.tile([0.075, 0.075, 0.075, 0.075, 0.7], (layers, 1))}
    monitor.reset()
    monitor.add(9, skipping)
    alarm = monitor.add(10, skipping)
    assert (alarm.layer, alarm.statistic) == (0, "skip_drift") and abs(alarm.value - 0.6) < 1e-9


def test_a_layer_whose_tokens_all_skip_is_one_alarm_and_no_numpy_warning():
    monitor = RoutingMonitor(
        load_config("tiny", ["resilience.routing_window=1", "resilience.routing_warmup=0"])
    )
    layers, classes = 2, 5
    all_skip = {
        "load": np.tile([0.0, 0.0, 0.0, 0.0, 1.0], (layers, 1)),  # no expert sees a token: 0 / 0
        "entropy": np.full(layers, 0.9),
        "pinned": np.zeros((layers, classes)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "invalid value encountered in divide" fails here
        alarm = monitor.add(1, all_skip)
    assert (alarm.layer, alarm.statistic) == (0, "load_ratio") and alarm.value == np.inf
