"""The health probes against fake ``amd-smi`` / ``rocm-smi`` / ``nvidia-smi`` executables and fake
``/sys`` trees: healthy, each failure, a tool missing or broken (the probe is skipped with one line,
never raises), and the monitor's once-per-finding reporting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zaya_jax.resilience import health
from zaya_jax.resilience.health import ClockProbe, FilesystemProbe, GpuProbe, HealthMonitor, NicProbe

AMD_HEALTHY = [{"gpu": 0, "ecc": {"total_correctable_count": 4, "total_uncorrectable_count": 0,
    "total_deferred_count": 0}, "pcie": {"replay_count": 3, "nak_sent_count": 0},
    "xgmi_err": "No Error", "throttle": {"throttle_status": "N/A"}}]  # fmt: skip
NO_BAD_PAGES = [{"gpu": 0, "retired": "No bad pages found.", "pending": "No bad pages found."}]


def _tool(directory: Path, name: str, outputs: dict[str, object], code: int = 0) -> Path:
    """A fake vendor tool: prints the output whose key is its first argument (JSON-encoded unless
    a string), exits ``code``."""
    directory.mkdir(parents=True, exist_ok=True)
    cases = "\n".join(
        f"  {key}) cat <<'OUT'\n{value if isinstance(value, str) else json.dumps(value)}\nOUT\n  ;;"
        for key, value in outputs.items()
    )
    path = directory / name
    path.write_text(f'#!/bin/sh\ncase "$1" in\n{cases}\nesac\nexit {code}\n')
    path.chmod(0o755)
    return directory


def _amd(tmp_path: Path, metric: object, pages: object = NO_BAD_PAGES) -> GpuProbe:
    return GpuProbe(path=str(_tool(tmp_path / "bin", "amd-smi", {"metric": metric, "bad-pages": pages})))


def test_a_healthy_amd_node_is_ok(tmp_path):
    (finding,) = _amd(tmp_path, AMD_HEALTHY).check()
    assert finding.status == "ok" and finding.detail["tool"] == "amd-smi"


def test_uncorrectable_ecc_errors_fail_naming_the_gpu(tmp_path):
    metric = json.loads(json.dumps(AMD_HEALTHY))
    metric.append(
        {**metric[0], "gpu": 3, "ecc": {"total_uncorrectable_count": 2, "umc_uncorrectable_count": 2}}
    )
    findings = _amd(tmp_path, metric).check()
    assert [(f.status, f.message) for f in findings] == [("fail", "GPU 3: 2 uncorrectable ECC errors")]
    assert findings[0].node == health.node_name() and findings[0].probe == "gpu"


def test_pending_retired_pages_and_xgmi_errors_fail(tmp_path):
    metric = [{**AMD_HEALTHY[0], "xgmi_err": "Multiple Errors"}]
    pages = [{"gpu": 0, "pending": [{"page_address": "0x1a2b", "status": "pending"},
                                    {"page_address": "0x1a2c", "status": "pending"}]}]  # fmt: skip
    messages = sorted(f.message for f in _amd(tmp_path, metric, pages).check() if f.status == "fail")
    assert messages == [
        "GPU 0: 2 retired pages pending",
        "GPU 0: XGMI link error (xgmi_err = Multiple Errors)",
    ]


def test_pcie_replays_warn_only_when_they_grow(tmp_path):
    probe = _amd(tmp_path, AMD_HEALTHY)
    assert probe.check()[0].status == "ok"  # 3 replays since boot: the baseline
    grown = [{**AMD_HEALTHY[0], "pcie": {"replay_count": 10, "nak_sent_count": 0}}]
    _tool(tmp_path / "bin", "amd-smi", {"metric": grown, "bad-pages": NO_BAD_PAGES})
    (finding,) = probe.check()
    assert (finding.status, finding.message) == ("warn", "GPU 0: PCIe replay_count grew by 7")


def test_rocm_smi_cards_are_read_when_amd_smi_is_missing(tmp_path):
    cards = {"card0": {"UMC Uncorrectable": "0"}, "card1": {"GFX Uncorrectable": {"value": 5}}}
    probe = GpuProbe(path=str(_tool(tmp_path / "bin", "rocm-smi", {"--showrasinfo": cards})))
    (finding,) = probe.check()
    assert (finding.status, finding.message) == ("fail", "GPU 1: 5 uncorrectable ECC errors")


def test_nvidia_smi_csv(tmp_path):
    rows = "0, 0, No, Not Active\n1, [N/A], [N/A], Active\n2, 1, Yes, Not Active"
    probe = GpuProbe(path=str(_tool(tmp_path / "bin", "nvidia-smi", {"*": rows})))
    found = [(f.status, f.message) for f in probe.check()]
    assert found == [
        ("warn", "GPU 1: hardware thermal slowdown"),
        ("fail", "GPU 2: 1 uncorrectable ECC errors"),
        ("fail", "GPU 2: retired pages pending"),
    ]


@pytest.mark.parametrize("case", ["missing", "exit code", "not json"], ids=lambda c: c.replace(" ", "_"))
def test_a_missing_or_broken_tool_skips_the_probe_with_one_line(tmp_path, case):
    if case == "missing":
        (tmp_path / "bin").mkdir()
    elif case == "exit code":
        _tool(tmp_path / "bin", "amd-smi", {"metric": "driver not loaded"}, code=8)
    else:
        _tool(tmp_path / "bin", "amd-smi", {"metric": "this is { not json", "bad-pages": "[]"})
    (finding,) = GpuProbe(path=str(tmp_path / "bin")).check()
    assert finding.status == "skipped" and "\n" not in finding.message
    expected = {"missing": "no amd-smi, rocm-smi or nvidia-smi", "exit code": "exit code 8",
                "not json": "could not be read"}  # fmt: skip
    assert expected[case] in finding.message


def _iface(root: Path, name: str, state: str = "up", carrier: str = "1", changes: int = 2, physical=True):
    d = root / "class" / "net" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "operstate").write_text(state + "\n")
    (d / "carrier").write_text(carrier + "\n")
    (d / "carrier_changes").write_text(f"{changes}\n")
    if physical:
        (d / "device").mkdir(exist_ok=True)


def _port(root: Path, state: str = "4: ACTIVE", link_downed: int = 0):
    d = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(state + "\n")
    (d / "counters" / "link_downed").write_text(f"{link_downed}\n")


def test_a_nic_that_goes_down_fails_and_carrier_flaps_warn(tmp_path):
    _iface(tmp_path, "lo", physical=False)
    _iface(tmp_path, "eth0")
    _iface(tmp_path, "eth1", state="down", carrier="0")  # down from the start: not watched
    _port(tmp_path)
    probe = NicProbe(tmp_path)
    assert [(f.status, f.message) for f in probe.check()] == [("ok", "2 links up")]
    _iface(tmp_path, "eth0", changes=5)
    _port(tmp_path, state="1: DOWN", link_downed=1)
    found = sorted((f.status, f.message) for f in probe.check())
    assert found == [
        ("fail", "mlx5_0/1 is down"),
        ("warn", "eth0: carrier_changes grew by 3"),
        ("warn", "mlx5_0/1: link_downed grew by 1"),
    ]


def test_a_required_interface_down_at_the_start_fails(tmp_path):
    _iface(tmp_path, "ib0", state="down", carrier="0")
    (finding,) = NicProbe(tmp_path, interfaces=["ib0"]).check()
    assert (finding.status, finding.message) == ("fail", "ib0 is down")


def test_no_interfaces_skip_the_nic_probe(tmp_path):
    (finding,) = NicProbe(tmp_path).check()
    assert finding.status == "skipped"


def test_filesystem_free_space_and_write_errors(tmp_path):
    ok = FilesystemProbe(tmp_path, lambda: 1, max_write_latency_s=60)
    assert [f.status for f in ok.check()] == ["ok"]
    full = FilesystemProbe(tmp_path, lambda: 1 << 62, max_write_latency_s=60)
    (finding,) = full.check()
    assert finding.status == "fail" and "the next checkpoint needs about" in finding.message
    assert finding.detail["fits"] is False and finding.detail["shared"]
    free = ok.free_bytes()
    low = FilesystemProbe(tmp_path, lambda: free * 2 // 3, 60, shared=False)  # room for 1.5
    (finding,) = low.check()
    assert "room for one more checkpoint" in finding.message
    assert finding.detail["fits"] is True and not finding.detail["shared"]
    floor = FilesystemProbe(tmp_path, lambda: 1, 60, min_free_bytes=1 << 62)
    assert floor.room().status == "fail" and ok.room() is None
    slow = FilesystemProbe(tmp_path, lambda: 1, max_write_latency_s=0.0)
    assert [f.status for f in slow.check()] == ["warn"]
    if os.geteuid() != 0:  # root writes through permissions
        tmp_path.chmod(0o500)
        assert FilesystemProbe(tmp_path, lambda: 1, 60).check()[0].status == "fail"
        tmp_path.chmod(0o700)
    missing = FilesystemProbe(tmp_path / "gone", lambda: 1, 60)
    assert missing.check()[0].status == "fail"


def _gathered(*clocks: float):
    def gather(name: str, value: str):
        return [value] * len(clocks) if name == "clock_barrier" else [repr(c) for c in clocks]

    return gather


def test_clock_skew_across_processes():
    assert ClockProbe(_gathered(100.0), 5.0).check()[0].status == "skipped"
    assert ClockProbe(_gathered(100.0, 100.2), 5.0).check()[0].status == "ok"
    (finding,) = ClockProbe(_gathered(100.0, 93.0), 5.0).check()
    assert finding.status == "fail" and "process 1 is behind" in finding.message


class _Scripted:
    name = "scripted"

    def __init__(self, *rounds):
        self.rounds = list(rounds)

    def check(self):
        status = self.rounds.pop(0)
        if status == "raise":
            raise KeyError("boom")
        return [health.Finding(self.name, status, f"it is {status}")]


def test_the_monitor_reports_each_finding_once_and_keeps_the_first_failure():
    monitor = HealthMonitor([_Scripted("ok", "warn", "warn", "fail", "raise", "ok", "warn")], every_s=0)
    seen = []
    for _ in range(7):
        monitor.check()
        seen.append([f.status for f in monitor.take()])
    assert seen == [[], ["warn"], [], ["fail"], ["skipped"], [], ["warn"]]
    assert monitor.failing.message == "it is fail"  # a failure is not forgotten when it clears
