"""`accelerate-zero doctor`: what a config does under each launcher (text from one table, `LAUNCHER_TEXT`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelerate_zero.cli import doctor
from accelerate_zero.cli.main import main


REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"


pytestmark = pytest.mark.usefixtures("clean_launch_env")  # tests/unit/conftest.py


def test_deepspeed_accelerate_config_under_each_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(CONFIGS / "zero3_demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "an accelerate config file" in out
    assert "starts 2 processes" in out and "ZeRO stage 3, every parameter sharded, fp32" in out
    assert "ImportError: DeepSpeed is not installed" in out  # accelerate launch without deepspeed
    assert "take over the DeepSpeed config" in out  # accelerate launch with deepspeed
    assert "torchrun does not read accelerate config files" in out
    installed = "deepspeed installed (this machine)" in out
    assert installed != ("deepspeed not installed (this machine)" in out)


def test_deepspeed_json(capsys: pytest.CaptureFixture[str]) -> None:
    path = REPO / "tests" / "fixtures" / "ds_config_zero2.json"
    assert main(["doctor", str(path), "--num_processes", "8"]) == 0
    out = capsys.readouterr().out
    assert f"--num_processes 8 --deepspeed_config_file {path}" in out
    assert "ZeRO stage 2, optimizer offload to cpu" in out
    assert f'TrainingArguments(zero_config="{path}")' in out


def test_invalid_config_names_the_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 9}}')
    assert main(["doctor", str(path)]) == 2
    out = capsys.readouterr().out
    assert "problem: zero_optimization.stage=9" in out
    assert doctor.LAUNCHER_TEXT["ours_bad"] in out


def test_every_sentence_comes_from_the_table() -> None:
    assert set(doctor.LAUNCHER_TEXT) >= {"ours", "accelerate_ds", "accelerate_no_ds", "torchrun_accel"}


def test_notes_are_printed_as_validate_prints_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key DeepSpeed ignores is accepted with a note: doctor says so too (once, not also logged)."""
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}, "comms_config": {"verbose": false}}')
    assert main(["doctor", str(path)]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in out.splitlines() if line.startswith("  note: ")]
    assert len(notes) == 1 and "comms_config" in notes[0] and "DeepSpeed ignores it too" in notes[0], out
    assert "comms_config" not in err
