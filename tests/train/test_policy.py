"""The driver's pure parts: the step-outcome policy and the generic metrics record."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from zaya_jax.config import ResilienceConfig
from zaya_jax.loss import MetricBound
from zaya_jax.train.decisions import Action, Outcome, decide
from zaya_jax.train.metrics import metric_record


def _outcome(skipped: bool, nonfinite: bool = False) -> Outcome:
    return Outcome(
        step=7, loss=float("nan") if nonfinite else 9.0, skipped=skipped, nonfinite=nonfinite, limit=3.0
    )


def test_policy_maps_each_outcome_to_its_configured_action():
    skip = ResilienceConfig(on_nonfinite="skip", on_spike="skip")
    assert decide(_outcome(False), skip, 0).action is Action.ACCEPT
    assert decide(_outcome(True, nonfinite=True), skip, 0).action is Action.SKIP
    assert decide(_outcome(True), skip, 0).action is Action.SKIP

    rollback = ResilienceConfig(on_nonfinite="rollback", on_spike="rollback", max_rollbacks=2)
    assert decide(_outcome(True, nonfinite=True), rollback, 1).action is Action.ROLLBACK
    assert decide(_outcome(True), rollback, 1).action is Action.ROLLBACK
    too_many = decide(_outcome(True, nonfinite=True), rollback, 2)
    assert too_many.action is Action.STOP and "resilience.max_rollbacks" in too_many.message

    stop = decide(_outcome(True, nonfinite=True), ResilienceConfig(on_nonfinite="stop"), 0)
    assert stop.action is Action.STOP and "step 7" in stop.message and "on_nonfinite=stop" in stop.message
    # a spike under on_spike=skip is skipped even when non-finite losses would stop the run
    assert (
        decide(_outcome(True), ResilienceConfig(on_nonfinite="stop", on_spike="skip"), 0).action
        is Action.SKIP
    )


def test_a_metric_past_its_bound_stops_or_skips_naming_metric_value_bound_and_setting():
    gap = MetricBound("sampler_gap", 0.5, "rl.max_sampler_gap", "the trainer does not reproduce the sampler")
    metrics = {
        "skipped": jnp.float32(1.0), "nonfinite": jnp.float32(0.0), "loss": jnp.float32(0.6),
        "bound_rejected": jnp.float32(1.0), "sampler_gap": jnp.float32(1.25),
    }  # fmt: skip
    outcome = Outcome.of(7, metrics, float("inf"), (gap,))
    assert outcome.exceeded == (gap, 1.25) and outcome.reason == "sampler_gap"
    stop = decide(outcome, ResilienceConfig(), 0)  # the default: stop
    assert stop.action is Action.STOP and stop.message.startswith(
        "step 7: sampler_gap 1.25 > rl.max_sampler_gap=0.5 (the trainer does not reproduce the sampler); "
        "resilience.on_metric_bound=stop"
    )
    # skipped under on_metric_bound=skip whatever the loss settings say
    skip = decide(outcome, ResilienceConfig(on_metric_bound="skip", on_nonfinite="stop"), 0)
    assert skip.action is Action.SKIP and "sampler_gap 1.25 > rl.max_sampler_gap=0.5" in skip.message
    # a non-finite loss is judged as one (NaN is past any bound too)
    nan = Outcome.of(
        7, {**metrics, "nonfinite": jnp.float32(1.0), "sampler_gap": jnp.float32("nan")}, 1.0, (gap,)
    )
    assert nan.reason == "nonfinite" and decide(nan, ResilienceConfig(on_nonfinite="skip"), 0).message == ""
    accepted = {**metrics, "skipped": jnp.float32(0.0), "bound_rejected": jnp.float32(0.0)}
    assert decide(Outcome.of(7, accepted, 1.0, (gap,)), ResilienceConfig(), 0).action is Action.ACCEPT


def test_outcome_reads_the_steps_guard_metrics():
    metrics = {"skipped": jnp.float32(1.0), "nonfinite": jnp.float32(0.0), "loss": jnp.float32(5.5)}
    outcome = Outcome.of(3, metrics, 4.0)
    assert (outcome.skipped, outcome.nonfinite, outcome.loss, outcome.reason) == (True, False, 5.5, "spike")


def test_metric_record_names_every_step_output_and_converts_arrays():
    metrics = {
        "loss": jnp.float32(2.5),
        "expert_load": jnp.asarray([0.123456, 0.876544]),
        "skipped": jnp.float32(0.0),  # steers the loop; not a metric of the run
        "nonfinite": jnp.float32(0.0),
    }
    record = metric_record(4, metrics, lr=np.float32(1e-3), tokens_seen=128)
    assert record == {
        "step": 4,
        "loss": 2.5,
        "expert_load": [0.1235, 0.8765],
        "lr": np.float32(1e-3).item(),
        "tokens_seen": 128,
    }
    assert all(type(v) in (int, float, list) for v in record.values())


def test_a_resumed_runs_progress_starts_at_its_step_and_rewinds_drop_later_lines(tmp_path):
    from zaya_jax.train.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, progress_total=10, resume_step=4)
    assert writer._bar.n == 4  # "4/10", not "0/10", for a run resumed after step 4
    for step in (5, 6, 7):
        writer.write({"step": step, "loss": float(step)})
    writer.rewind(5)  # a rollback to step 5 re-runs 6 and 7
    writer.write({"step": 6, "loss": 0.5})
    writer.event("stop", signal="SIGTERM")
    writer.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 6]
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["step"], event["detail"]) == ("stop", 6, {"signal": "SIGTERM"})


def test_dashboard_trackers_get_flat_scalars_under_a_stable_run_id(tmp_path, monkeypatch):
    """wandb and trackio (optional extras) behind the Tracker protocol, with a stand-in module."""
    import sys
    import types

    import pytest

    from zaya_jax.config import ConfigError, load_config
    from zaya_jax.train.metrics import MetricsWriter

    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)),
        log=lambda data, step: calls.append(("log", step, data)),
        finish=lambda: calls.append(("finish",)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config("tiny", ["log.trackers=[wandb]", "log.project=p", "run.name=r"])
    for _ in range(2):  # a resumed run opens the same dashboard run
        writer = MetricsWriter(tmp_path, enabled=True, cfg=cfg)
        writer.write({"step": 3, "loss": 2.0, "expert_load": [0.25, 0.75], "mfu": None})
        writer.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] and inits[0]["project"] == "p" and inits[0]["resume"] == "allow"
    assert ("log", 3, {"loss": 2.0, "expert_load/0": 0.25, "expert_load/1": 0.75}) in calls
    assert not (tmp_path / "tb").exists()  # TensorBoard only when listed
    monkeypatch.setitem(sys.modules, "trackio", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install 'zaya-jax\[trackio\]'"):
        MetricsWriter(tmp_path, cfg=load_config("tiny", ["log.trackers=[trackio]"]))


def test_tensorboard_purges_the_steps_a_rollback_repeats(tmp_path):
    """After a rewind TensorBoard gets a new event file starting with SessionLog START at the first
    repeated step (its purge_step), which makes TensorBoard drop the older points from there on."""
    import struct

    from tensorboardX.proto import event_pb2

    from zaya_jax.train.metrics import MetricsWriter

    def events(path):
        data, out = path.read_bytes(), []
        while data:
            (length,) = struct.unpack("<Q", data[:8])
            out.append(event_pb2.Event.FromString(data[12 : 12 + length]))
            data = data[12 + length + 4 :]
        return out

    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": float(step)})
    writer.rewind(1)
    writer.write({"step": 2, "loss": 0.5})
    writer.close()
    files = sorted((tmp_path / "tb").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    purges = [(e.step, e.session_log.status) for f in files for e in events(f) if e.HasField("session_log")]
    assert (2, event_pb2.SessionLog.START) in purges
