"""Wrong input found early and named: a config file that is not UTF-8 (validate, initialize, the Trainer)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError


@pytest.fixture
def latin1_config(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_bytes('{"zero_optimization": {"stage": 2}, "comment": "caf\u00e9"}'.encode("latin-1"))
    return path


def test_a_non_utf8_config_names_the_file(latin1_config: Path) -> None:
    with pytest.raises(ZeroConfigError, match=rf"config file '{latin1_config}' is not UTF-8 text .*save it as UTF-8"):
        ZeroConfig.from_any(latin1_config)


def test_validate_exits_2_naming_the_file(latin1_config: Path, capsys: pytest.CaptureFixture) -> None:
    from accelerate_zero.cli.validate import run

    assert run(argparse.Namespace(config=str(latin1_config), world_size=1)) == 2
    assert f"'{latin1_config}' is not UTF-8" in capsys.readouterr().err


def test_trainer_arguments_name_the_file(latin1_config: Path, tmp_path: Path) -> None:
    # `initialize(config=path)` reads the file with the same ZeroConfig.from_any (not called here: it would create a
    # process group in the pytest process).
    from accelerate_zero.integrations.transformers import ZeroTrainingArguments

    with pytest.raises(ZeroConfigError, match=f"'{latin1_config}' is not UTF-8"):
        ZeroTrainingArguments(output_dir=str(tmp_path / "out"), zero_config=str(latin1_config), use_cpu=True)
