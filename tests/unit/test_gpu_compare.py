"""bench/gpu_compare.py, the side-by-side offload benchmark a lent GPU runs (issue 40): its dry run on the CPU, so
that the GPU session does not die on a typo, the estimator's largest model per mode, and the timeline's lanes from a
GPU-shaped trace."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest


BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_compare  # noqa: E402
import gpu_compare_worker  # noqa: E402


def _event(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_lanes_from_a_gpu_trace() -> None:
    """Kernels make the compute lane, memcpy events the copy lanes (the CPU-side copy ranges are ignored when a GPU
    reports its own), ranges are merged, clipped to the last step and measured as a share of it."""
    trace = {
        "traceEvents": [
            _event("bench::step", "user_annotation", 0, 500),  # an earlier step: ignored
            _event("bench::step", "user_annotation", 1000, 1000),
            _event("gemm", "kernel", 1000, 300),
            _event("gemm", "kernel", 1200, 200),  # overlaps the first: the union is 1000-1400
            _event("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 1300, 100),
            _event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 1900, 200),  # runs past the step: clipped
            _event("ZeRO::copy_to_host", "user_annotation", 1300, 10),
            _event("ZeRO::optimizer_step", "user_annotation", 1500, 300),
            _event("ZeRO::file_write", "user_annotation", 1600, 50),
            _event("aten::mm", "cpu_op", 1000, 900),  # not a lane
        ]
    }
    timeline = gpu_compare_worker.lanes_from_trace(trace)
    assert timeline["gpu"] and timeline["step_ms"] == 1.0
    assert timeline["lanes"] == {
        "compute": [[0.0, 0.4]],
        "device-to-host": [[0.3, 0.4]],
        "host step": [[0.5, 0.8]],
        "host-to-device": [[0.9, 1.0]],
        "file I/O": [[0.6, 0.65]],
    }
    assert timeline["busy"]["compute"] == 0.4 and timeline["busy"]["host-to-device"] == 0.1
    ElementTree.fromstring(gpu_compare_worker.svg(timeline, "a <title> & more"))  # well-formed SVG
    with pytest.raises(ValueError, match="bench::step"):
        gpu_compare_worker.lanes_from_trace({"traceEvents": [_event("gemm", "kernel", 0, 1)]})


def test_dry_run_on_the_cpu(tmp_path: Path) -> None:
    """The prepared script end to end on a tiny model: ours in every mode it has (NVMe included, so the file I/O
    lane is drawn), FSDP2 where it applies, rows for what does not apply; ours and FSDP2 train the same model the
    same way (equal losses), and each timeline is drawn."""
    out = tmp_path / "out"
    argv = ["--dry_run", "--systems", "ours", "fsdp2", "--modes", "cpu+param", "nvme", "cpu/sync", "--out", str(out)]
    argv += ["--nvme_dir", str(tmp_path / "nvme"), "--timeout", "240"]
    assert gpu_compare.main(argv) == 0
    rows = {(r["system"], r["mode"]): r for r in json.loads((out / "results.json").read_text())["results"]}
    assert set(rows) == {
        ("ours", "cpu+param"),
        ("ours", "nvme"),
        ("ours", "cpu/sync"),
        ("fsdp2", "cpu+param"),
        ("fsdp2", "nvme"),
    }
    assert "CPUOffloadPolicy" in rows["fsdp2", "nvme"]["skipped"]
    ours, fsdp2 = rows["ours", "cpu+param"], rows["fsdp2", "cpu+param"]
    for row in (ours, fsdp2, rows["ours", "nvme"]):
        assert row["tokens_per_second"] > 0 and row["host_peak_gib"] > 0 and len(row["losses"]) == 3
    # the host step overlapped (ours, every mode) or not (cpu/sync): the same training
    assert ours["losses"] == fsdp2["losses"] == rows["ours", "nvme"]["losses"] == rows["ours", "cpu/sync"]["losses"]
    assert ours["losses"][2] < ours["losses"][0]
    assert ours["host_step_overlapped"] and not rows["ours", "cpu/sync"]["host_step_overlapped"]
    assert ours["measured"]["copy_gbps"] > 0 and ours["measured"]["host_rate"] > 0  # for the predicted column
    nvme = rows["ours", "nvme"]["timeline"]
    assert nvme["busy"]["file I/O"] > 0 and nvme["busy"]["host step"] > 0 and nvme["busy"]["compute"] > 0
    for stem in ("timeline_ours_cpu_param", "timeline_ours_nvme"):
        ElementTree.parse(out / f"{stem}.svg")
    assert "fsdp2" not in " ".join(p.name for p in out.glob("timeline_*"))
    for row in (ours, rows["ours", "nvme"]):  # the estimate beside the device peak (none on a CPU)
        assert row["estimate_gib"] > 0 and row["phase_peak_gib"] == {} and row["device_peak_gib"] is None
    assert "estimate_gib" not in fsdp2
    text = (out / "table.md").read_text()
    assert "| ours | nvme |" in text and "skipped: FSDP2" in text


def test_largest_prints_the_estimator_s_largest_model_per_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """Offload fits more layers in the same GPU (then the RAM binds); NVMe is bound by the disk."""
    argv = ["--largest", "--hidden", "256", "--batch", "2", "--seq", "64", "--vocab", "1024", "--gpu_gib", "0.15"]
    assert gpu_compare.main([*argv, "--cpu_gib", "0.4", "--disk_gb", "0.1"]) == 0
    layers = {line.split(":")[0]: int(line.split()[1]) for line in capsys.readouterr().out.splitlines()}
    assert set(layers) == {"none", "cpu", "cpu+param", "nvme"}
    assert layers["none"] < layers["cpu"] <= layers["cpu+param"] and layers["nvme"] < layers["cpu"]


def test_predictions_come_from_our_no_offload_step_and_the_measured_figures() -> None:
    """The table's predicted column is `accelerate-zero estimate`'s model fed with the same run's figures."""
    from accelerate_zero.debug.step_time import Measured, offload_step_seconds

    figures = {"copy_gbps": 20.0, "host_rate": 1e9}
    rows = [
        {"system": "ours", "mode": "none", "step_seconds": 0.6, "numel": 10**9, "measured": figures},
        {"system": "ours", "mode": "cpu", "step_seconds": 2.0, "numel": 10**9, "measured": figures},
        {"system": "deepspeed", "mode": "cpu", "step_seconds": 2.5, "numel": 10**9},
        {"system": "ours", "mode": "nvme", "step_seconds": 9.0, "numel": 10**9, "measured": figures},
    ]
    args = gpu_compare.parse_args(["--accumulation", "4"])
    gpu_compare.add_predictions(args, rows)
    assert rows[1]["predicted"] == offload_step_seconds(10**9, 3, "cpu", 4, Measured(0.6, 20.0, 1e9))
    assert all("predicted" not in rows[i] for i in (0, 2, 3))
