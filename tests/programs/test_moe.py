"""``model.moe_impl: auto``: the measured-fastest dropless path, cached per device kind and shapes,
recorded in the start event and the plan, fixed where it cannot be measured; ``zaya doctor --moe``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.fixtures import MINI
from zaya_jax.cli import main
from zaya_jax.config import load_config
from zaya_jax.objectives import build_programs
from zaya_jax.parallel import make_layout
from zaya_jax.programs import moe
from zaya_jax.programs.moe import ChoiceCache, choose, measure, resolve_moe_impl


def _events(run):
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_measure_times_every_dropless_path():
    import jax

    cfg = load_config("tiny", overrides=MINI).model
    seconds = measure(cfg, 64, jax.devices()[0], rounds=1)
    assert set(seconds) == {"sorted", "dense"} and all(0 < s < 60 for s in seconds.values())


@pytest.mark.parametrize("fastest", ["sorted", "dense"])
def test_the_measured_fastest_is_chosen_and_cached(tmp_path, monkeypatch, fastest):
    import jax

    timings = {"sorted": 2.0, "dense": 3.0} if fastest == "sorted" else {"sorted": 3.0, "dense": 1.0}
    calls = []
    monkeypatch.setattr(moe, "measure", lambda *a, **k: calls.append(a) or dict(timings))
    cfg, device = load_config("tiny").model, jax.devices()[0]
    cache = ChoiceCache(tmp_path / "moe_auto.json")
    first = choose(cfg, 512, device, cache)
    assert (first.impl, first.source, first.seconds) == (fastest, "measured", timings)
    second = choose(cfg, 512, device, ChoiceCache(tmp_path / "moe_auto.json"))  # a new process
    assert (second.impl, second.source) == (fastest, "cached") and len(calls) == 1
    other = choose(cfg, 1024, device, cache)  # other shapes: measured again
    assert other.source == "measured" and len(calls) == 2
    assert len(json.loads((tmp_path / "moe_auto.json").read_text())) == 2


def test_an_unreadable_cache_is_measured_again(tmp_path, monkeypatch):
    import jax

    path = tmp_path / "moe_auto.json"
    path.write_text("{not json")
    monkeypatch.setattr(moe, "measure", lambda *a, **k: {"sorted": 1.0, "dense": 2.0})
    assert choose(load_config("tiny").model, 64, jax.devices()[0], ChoiceCache(path)).source == "measured"
    assert json.loads(path.read_text())  # rewritten whole


def test_a_run_records_the_choice_and_the_next_run_takes_it_from_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZAYA_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("a", "b"):
        assert main(["train", *MINI, f"run.dir={tmp_path / name}", "train.steps=2", "--no-progress"]) == 0
    capsys.readouterr()
    (start_a,) = [e["detail"] for e in _events(tmp_path / "a") if e["event"] == "start"]
    (start_b,) = [e["detail"] for e in _events(tmp_path / "b") if e["event"] == "start"]
    assert start_a["moe"]["source"] == "measured" and set(start_a["moe"]["seconds"]) == {"sorted", "dense"}
    assert start_a["moe"]["impl"] == min(start_a["moe"]["seconds"], key=start_a["moe"]["seconds"].get)
    assert start_b["moe"]["source"] == "cached" and start_b["moe"]["impl"] == start_a["moe"]["impl"]


def test_auto_is_fixed_where_it_cannot_be_measured(monkeypatch):
    monkeypatch.setattr(moe, "measure", lambda *a, **k: pytest.fail("measured"))
    from zaya_jax.ops.platform import planning_for

    cfg = load_config("tiny")
    with planning_for("gpu"):
        resolved, choice = resolve_moe_impl(cfg, make_layout(cfg))
    assert resolved.model.moe_impl == "sorted" and "no --gpu-kind named" in choice.source
    explicit = load_config("tiny", overrides=["model.moe_impl=dense"])
    assert build_programs(explicit).moe.source == "configured"
    assert build_programs(explicit).cfg.model.moe_impl == "dense"


def test_doctor_moe_measures_and_prints_the_choice(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZAYA_CACHE_DIR", str(tmp_path))
    assert main(["doctor", "--moe", "--json", *MINI]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "measured" and report["impl"] in ("sorted", "dense")
    assert np.isfinite(list(report["seconds"].values())).all()
    assert report["impl"] in json.dumps(json.loads((tmp_path / "moe_auto.json").read_text()))
    assert main(["doctor", "--moe", *MINI]) == 0
    assert "moe_impl auto ->" in capsys.readouterr().out


def test_a_gpu_plan_takes_the_choice_measured_on_the_named_gpu(tmp_path, monkeypatch):
    """--compile-only --gpu-kind H200 plans the path auto measured on an H200 at these shapes (here
    a cached ``dense``: no grouped GEMM in the program); without a measurement, ``sorted``."""
    from zaya_jax.programs.moe import choice_key, tokens_per_device
    from zaya_jax.train.plan import compile_plan

    monkeypatch.setenv("ZAYA_CACHE_DIR", str(tmp_path))
    cfg = load_config("tiny", overrides=MINI)
    device = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA H200"})()
    key = choice_key(cfg.model, tokens_per_device(cfg, make_layout(cfg)), device)
    (tmp_path / "moe_auto.json").write_text(json.dumps({key: {"impl": "dense", "seconds": {"dense": 1e-3}}}))
    h200 = compile_plan(cfg, "gpu", gpu_kind="h200")
    assert h200["moe_impl"]["impl"] == "dense" and "NVIDIA H200" in h200["moe_impl"]["source"]
    assert "ragged_dot_gpu_twin" not in h200["platform_paths"]
    mi300x = compile_plan(cfg, "gpu", gpu_kind="MI300X")
    assert (
        mi300x["moe_impl"]["impl"] == "sorted"
        and "no choice cached for 'MI300X'" in mi300x["moe_impl"]["source"]
    )
    assert "ragged_dot_gpu_twin" in mi300x["platform_paths"]


def test_an_option_variant_is_timed_with_its_compiler_option():
    """doctor --moe on ROCm also times ``sorted`` compiled with the grouped-GEMM option (never
    chosen by auto: the flag is process-wide); the option reaches the compiler (XLA:CPU ignores a
    GPU option, so here it only has to compile and run)."""
    import jax

    cfg = load_config("tiny", overrides=MINI).model
    seconds = measure(cfg, 64, jax.devices()[0], ("sorted",), rounds=1, variants=("sorted_grouped_gemm",))
    assert set(seconds) == {"sorted", "sorted_grouped_gemm"} and all(0 < s < 60 for s in seconds.values())


def test_a_path_whose_plan_would_not_fit_is_not_run_to_be_timed(monkeypatch):
    """The dense path computes every expert for every token: where its compiled plan takes more
    than half of the device's memory it is left out of the timing (the ``small`` preset's dense
    path would have taken 21 GB of a 24 GB host before the run's own fit check)."""
    import jax

    from zaya_jax.programs.memory import peak_bytes

    cfg = load_config("tiny").model
    device = jax.devices()[0]
    plans = {
        impl: peak_bytes(moe._program(impl, cfg, 4096, device)[0].memory_analysis()) for impl in moe.PATHS
    }
    assert plans["dense"] > plans["sorted"]
    budget = (plans["dense"] + plans["sorted"]) // 2  # half of it fits sorted, not dense
    monkeypatch.setattr(moe, "device_capacity", lambda **kwargs: (2 * budget, "a small device"))
    assert "dense" not in measure(cfg, 4096, device, rounds=1) and "sorted" in measure(
        cfg, 4096, device, rounds=1
    )
    monkeypatch.setattr(moe, "device_capacity", lambda **kwargs: (1, "no memory at all"))
    assert list(measure(cfg, 4096, device, rounds=1)) == [
        min(plans, key=plans.get)
    ]  # the least, untimed by others
