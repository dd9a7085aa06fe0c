"""`accelerate-zero estimate --cpu_checkpointing`: the saved activations move from the device figure to each rank's
host memory ([Note: activations in host memory, estimated] in debug/activations_host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelerate_zero.debug import estimate as est
from accelerate_zero.debug.activations_host import cpu_checkpointed_bytes
from tests.unit.test_estimate import TINY_LLAMA, estimate_json, write_config


def test_cpu_checkpointing_moves_all_but_one_layer() -> None:
    arch = est.Architecture(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000)
    s, b, h = 2048, 1, 4096
    setup = dict(micro_batch=b, seq_len=s, compute_bytes=2)
    assert cpu_checkpointed_bytes(arch, **setup, gradient_checkpointing=True) == 32 * 2 * s * b * h
    assert cpu_checkpointed_bytes(arch, **setup) == 31 * 34 * s * b * h


def test_cli_reports_the_host_activations(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = str(write_config(tmp_path / "tiny", TINY_LLAMA))
    argv = ("--config_json", folder, "--num_gpus", "2", "--gpu_memory", "1GB", "--gradient_checkpointing")
    plain, moved = estimate_json(capsys, *argv), estimate_json(capsys, *argv, "--cpu_checkpointing")
    assert moved["setup"]["cpu_checkpointing"] and not plain["setup"]["cpu_checkpointing"]
    host = moved["estimates"][0]["host_per_rank"]["activations"]
    assert host == 3 * 2048 * 32 * 2  # 3 layers' checkpoints: s*b*h bf16 elements of 2 bytes
    assert moved["activations"] == plain["activations"] - host
    for before, after in zip(plain["estimates"], moved["estimates"], strict=True):
        assert after["device"]["total"] == before["device"]["total"] - host
        assert after["host_per_rank"]["total"] == before["host_per_rank"]["total"] + host
        assert after["cpu_ram_per_node"] == before["cpu_ram_per_node"] + 2 * host
