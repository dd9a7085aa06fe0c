"""`accelerate-zero estimate`'s peak per phase ([Note: the peak of each phase] in accelerate_zero/debug/phases.py):
each phase adds up the kinds the engine holds then, and on the benchmark workload (bench/README.md, "user_load.py"
and "Stages 0-2 against DDP, ZeroRedundancyOptimizer and DeepSpeed": a 66.9M Llama, 4 ranks, fp32 AdamW, 1 x 64
tokens) the estimate stays within 10% of the peaks measured there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.unit.test_estimate import LLAMA_13B, estimate_json, write_config


# bench/user_load.py (phase_peaks.py folded in), 2026-11-26: anonymous peak per rank above the baseline, MB (1e6 B).
MEASURED_MB = {
    0: {"init": 270.0, "forward": 860.2, "backward": 1149.1, "optimizer_step": 1081.8, "between_steps": 814.4},
    1: {"init": 270.0, "forward": 458.6, "backward": 790.8, "optimizer_step": 714.1, "between_steps": 413.1},
    2: {"init": 270.0, "forward": 459.2, "backward": 798.0, "optimizer_step": 480.4, "between_steps": 413.5},
    # the stage-3 backward with `--arena_whole`: the gradient arena counted from its allocation, as on a device
    # ([Note: resident pages against allocated bytes] in bench/harness/readings.py); 584.5 by RSS alone
    3: {"init": 69.6, "forward": 526.4, "backward": 617.0, "optimizer_step": 281.5, "between_steps": 214.7},
}
BENCH_LLAMA = {**LLAMA_13B, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 10}
BENCH_LLAMA.update(num_attention_heads=8, num_key_value_heads=8)


def test_each_phase_adds_the_kinds_held_then(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = write_config(tmp_path / "llama13b", LLAMA_13B)
    report = estimate_json(capsys, "--config_json", str(folder), "--num_gpus", "8", "--seq_len", "1024")
    activations = report["activations"]
    h, i = LLAMA_13B["hidden_size"], LLAMA_13B["intermediate_size"]
    largest_param = LLAMA_13B["vocab_size"] * h * 4  # the untied embedding / LM head, fp32 gradient
    largest_unit = (4 * h * h + 3 * h * i) * 4  # a decoder layer's matrices (its norms stay whole: persistent)
    for row in report["estimates"]:
        device, phases = row["device"], row["phases"]
        held = device["parameters"] + device["master_weights"] + device["optimizer_states"]
        assert phases["init"] == device["parameters"] + device["master_weights"]
        assert phases["between_steps"] == held
        assert phases["optimizer_step"] == held + device["gradients"]
        assert phases["forward"] == held + device["gathered_parameters"] + activations
        grads, gathered = device["gradients"], device["gathered_parameters"]
        if row["stage"] == 3:
            assert phases["backward"] == held + grads + gathered + activations + largest_unit
        else:
            assert phases["backward"] == held + grads + device["communication_buffers"] + largest_param
        assert phases["init"] <= phases["between_steps"] <= phases["optimizer_step"] <= phases["backward"]


def test_the_phases_track_the_measured_peaks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = write_config(tmp_path / "bench_llama", BENCH_LLAMA)
    args = ["--config_json", str(folder), "--num_gpus", "4", "--mixed_precision", "no", "--seq_len", "64"]
    report = estimate_json(capsys, *args, "--micro_batch", "1", "--offload", "none")
    ratios = {}
    for row in report["estimates"]:
        for phase, measured in MEASURED_MB[row["stage"]].items():
            ratios[(row["stage"], phase)] = row["phases"][phase] / (measured * 1e6)
    off = {cell: round(r, 3) for cell, r in ratios.items() if not math.isclose(r, 1.0, abs_tol=0.1)}
    assert not off, off
    assert 1.0 <= ratios[(3, "backward")] <= 1.1, "an upper bound there: all that can coexist at backward's start"
    print(json.dumps({f"{s}-{p}": round(r, 3) for (s, p), r in ratios.items()}))
