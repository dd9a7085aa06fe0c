"""`accelerate-zero validate`: "auto" values are reported as filled at run time; accelerate config files are read
as `accelerate-zero launch` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from accelerate_zero.cli.main import main
from accelerate_zero.config import ZeroConfig


REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
CONFIGS = REPO / "accelerate_configs"


pytestmark = pytest.mark.usefixtures("clean_launch_env")  # tests/unit/conftest.py


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_transformers_configs_are_valid_and_their_autos_listed(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    written = json.loads((FIXTURES / name).read_text())
    assert main(["validate", str(FIXTURES / name), "--world_size", "4"]) == 0
    captured = capsys.readouterr()
    resolved = json.loads(captured.out)
    assert resolved["zero_optimization"]["stage"] == written["zero_optimization"]["stage"]
    assert resolved["optimizer"]["params"]["lr"] == written["optimizer"]["params"]["lr"]  # "auto" stays "auto"
    assert "is valid for world size 4" in captured.err
    assert "nothing filled it" not in captured.err
    autos = ZeroConfig.from_any(written).auto_keys()
    listed = [line.split()[0] for line in captured.err.splitlines() if "<-" in line]
    assert listed == autos


def test_unfilled_auto_is_reported_not_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"gradient_clipping": "auto", "train_micro_batch_size_per_gpu": 2}))
    assert main(["validate", str(path), "--world_size", "2"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["gradient_clipping"] == "auto" and out["train_batch_size"] == 4
    assert "gradient_clipping" in captured.err and "max_grad_norm" in captured.err


def test_batch_rule_is_still_checked_beside_autos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 8,
                "gradient_clipping": "auto",
            }
        )
    )
    assert main(["validate", str(path), "--world_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "train_batch_size=32 != train_micro_batch_size_per_gpu=4 * gradient_accumulation_steps=8" in err


@pytest.mark.parametrize(
    "name", ["zero1.yaml", "zero2.yaml", "zero3.yaml", "zero3_demo.yaml", "zero3_offload.yaml", "zero3_nvme.yaml"]
)
def test_accelerate_configs_are_read_as_the_launcher_reads_them(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    block = yaml.safe_load((CONFIGS / name).read_text())["deepspeed_config"]
    assert main(["validate", str(CONFIGS / name)]) == 0
    captured = capsys.readouterr()
    assert "unknown key" not in captured.err
    assert f"accelerate config {CONFIGS / name} is valid for world size 2" in captured.err
    assert json.loads(captured.out)["zero_optimization"]["stage"] == block["zero_stage"]


def test_accelerate_config_problems_are_the_launchers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load((CONFIGS / "zero2.yaml").read_text())
    config["deepspeed_config"]["offload_optimizer_device"] = "nvme"  # no path
    path = tmp_path / "nvme.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"accelerate-zero: invalid accelerate config {path}:")
    assert "no NVMe folder is set" in err


def test_example_ds_config_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(CONFIGS / "ds_config.json"), "--world_size", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_optimization"]["stage"] == 3
