"""Migrating without edits (issue 17): `deepspeed=` / `--deepspeed` as zero_config, two config sources that
disagree, accelerate's documented stage-3 save snippet on every rank, and the user's own `accelerate launch` with a
DEEPSPEED config and deepspeed installed (taken over: our engine trains, no rank imports deepspeed)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import run_distributed, scaled_seconds
from tests.integration import migration_checks


def ds_config(stage: int = 3, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": stage}, **extra}


def training_args(tmp_path: Path, **kwargs: Any) -> Any:
    from accelerate_zero import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, **kwargs)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_ZERO_CONFIG", raising=False)


def test_deepspeed_argument_is_read_as_zero_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config()))
    with caplog.at_level(logging.WARNING):
        args = training_args(tmp_path, deepspeed=str(path))
    assert (args.zero_config, args.deepspeed, args.zero_stage) == (str(path), None, 3)
    assert args.zero_fill.config["train_micro_batch_size_per_gpu"] == args.per_device_train_batch_size
    notices = [r.getMessage() for r in caplog.records if "zero_config" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0]
    # That this imports no deepspeed is asked of a fresh interpreter, with the other import probes:
    # tests/unit/test_package_imports.py (other tests of this session may have imported it here).


def test_deepspeed_command_line_flag(tmp_path: Path) -> None:
    from transformers import HfArgumentParser

    from accelerate_zero import TrainingArguments

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config(stage=1)))
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "out"), "--deepspeed", str(path), "--use_cpu", "--report_to", "none"]
    )
    assert (args.deepspeed, args.zero_stage) == (None, 1)


def test_deepspeed_and_a_different_zero_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two different ZeRO configs"):
        training_args(tmp_path, deepspeed=ds_config(stage=3), zero_config=ds_config(stage=2))
    assert training_args(tmp_path, deepspeed=ds_config(stage=2), zero_config=ds_config(stage=2)).zero_stage == 2


def test_zero_config_conflicting_with_the_launcher_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = ds_config(stage=3, bf16={"enabled": False}, gradient_clipping="auto")
    launcher["zero_optimization"]["stage3_prefetch_bucket_size"] = 5e8
    monkeypatch.setenv("ACCELERATE_ZERO_CONFIG", json.dumps(launcher))
    with pytest.raises(ValueError) as error:
        training_args(tmp_path, zero_config=ds_config(stage=2, gradient_clipping=0.5))
    message = str(error.value)
    assert "- zero_config zero_optimization.stage=2 vs launcher zero_optimization.stage=3" in message
    assert "- zero_config gradient_clipping" not in message  # "auto" on one side is no conflict
    # the same values (an alias, a number written as a string) and keys only one side sets are no conflict
    agreeing = ds_config(stage=3)
    agreeing["zero_optimization"]["prefetch_bucket_size"] = "5e8"
    assert training_args(tmp_path, zero_config=agreeing).zero_stage == 3
    with pytest.raises(ValueError, match="- zero_config bf16.enabled=True vs launcher bf16.enabled=False"):
        training_args(tmp_path, deepspeed=ds_config(stage=3, bfloat16={"enabled": True}))


def test_accelerate_stage3_save_snippet_works_on_every_rank(tmp_path: Path) -> None:
    ranks = run_distributed(migration_checks.save_snippet, 2, str(tmp_path))
    main, other = ranks
    assert main["max_diff"] == 0.0  # fp32: the saved weights are the trained ones exactly
    assert "model.safetensors" in main["files"] and "config.json" in main["files"]
    assert main["keys"] == other["keys"] and other["devices"] == ["meta"] and main["devices"] == ["cpu"]
    assert main["shapes_match_main"] and other["shapes_match_main"]


REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "integration" / "scripts"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    return {**env, "PYTHONPATH": str(REPO), "ACCELERATE_ZERO_PG_TIMEOUT": scaled_seconds(120)}


def _check_trained_with_our_engine(out: Path, stage: int) -> None:
    for rank in range(2):
        run = json.loads((out / f"trainer_rank{rank}.json").read_text())
        assert (run["stage"], run["world_size"], run["deepspeed_plugin"]) == (stage, 2, False)
        assert run["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.MULTI_GPU")
        assert not run["deepspeed_imported"] and len(run["losses"]) == 2


def test_accelerate_deepspeed_launch_environment_trains_with_our_engine(tmp_path: Path) -> None:
    """What `accelerate launch --config_file zero3.yaml` gives the ranks with deepspeed installed, replayed with
    accelerate's own functions (scripts/accelerate_deepspeed_launch.py), so this runs without deepspeed too."""
    command = [sys.executable, str(SCRIPTS / "accelerate_deepspeed_launch.py"), "--main_process_port", "0"]
    command += ["--config_file", str(REPO / "accelerate_configs" / "zero3.yaml")]
    command += [str(SCRIPTS / "trainer_tiny.py"), "--out", str(tmp_path)]
    done = subprocess.run(command, env=_launch_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training with accelerate_zero's ZeRO engine (stage 3); deepspeed is not used" in done.stderr
    _check_trained_with_our_engine(tmp_path, stage=3)


# The seeds' tutorial zero3_config.yaml (bf16, 8 processes: 2 on the command line, DeepSpeed keys accelerate does not
# export), plus what the takeover must carry to the engine: CPU offload of the optimizer and the parameters,
# gradient accumulation and clipping.
TAKEOVER_CONFIG = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 3
  stage3_prefetch_bucket_size: 5e8
  stage3_param_persistence_threshold: 1e6
  overlap_comm: true
  offload_optimizer_device: cpu
  offload_param_device: cpu
  gradient_accumulation_steps: 2
  gradient_clipping: 0.5
distributed_type: DEEPSPEED
num_processes: 8
mixed_precision: bf16
"""
TAKEOVER_RUNS = ("loop", "trainer")
TRAINER_FLAGS = ["--bf16", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"]
"""The Trainer's arguments must agree with the accelerate config, as under DeepSpeed."""


def _accelerate_launch() -> list[str]:
    """accelerate's own `accelerate launch` (the console script next to this Python, else its module)."""
    script = Path(sys.executable).with_name("accelerate")
    return [str(script), "launch"] if script.exists() else [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture(scope="module")
def takeover(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `accelerate launch` whose ranks run the loop, then the Trainer (the script's `--then_trainer`)."""
    assert HAS_DEEPSPEED, (
        "deepspeed is not installed, and `accelerate launch` refuses a DEEPSPEED config without it: install the "
        "test extra (`DS_BUILD_OPS=0 pip install -e '.[test]'`; scripts/install.sh does)"
    )
    out = tmp_path_factory.mktemp("takeover")
    config = out / "zero3.yaml"
    config.write_text(TAKEOVER_CONFIG)
    command = [*_accelerate_launch(), "--config_file", str(config), "--num_processes", "2", "--main_process_port", "0"]
    command += [str(SCRIPTS / "accelerate_launch_takeover.py"), "--out", str(out), "--then_trainer", *TRAINER_FLAGS]
    done = subprocess.run(command, env=_launch_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training with accelerate_zero's ZeRO engine (stage 3); deepspeed is not used" in done.stderr
    return out


@pytest.mark.parametrize("run", TAKEOVER_RUNS)
def test_literal_accelerate_launch_with_deepspeed_installed(takeover: Path, run: str) -> None:
    """`accelerate launch` itself, deepspeed installed (the `test` extra installs it, ops off): a ZeroAccelerator loop
    and the Trainer train with our engine at the settings accelerate exported, and no rank imports deepspeed."""
    tmp_path = takeover
    for rank in range(2):
        ran = json.loads((tmp_path / f"{run}_rank{rank}.json").read_text())
        assert ran["deepspeed_modules"] == [], f"rank {rank} imported deepspeed: {ran['deepspeed_modules']}"
        # started by accelerate's DeepSpeed launcher, then switched off its DeepSpeed path
        assert ran["launched_with"]["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" and ran["use_deepspeed"] == "false"
        assert ran["launched_with"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert ran["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.MULTI_GPU")
        assert ran["world_size"] == 2 and ran["losses_finite"]
        # the settings arrived, as the engine trains with them
        assert (ran["stage"], ran["offload_optimizer"], ran["offload_params"]) == (3, True, True)
        assert ran["offload_devices"] == ["cpu", "cpu"]
        assert (ran["engine_accumulation"], ran["gradient_clipping"]) == (2, 0.5)
        assert ran["bf16"] and ran["compute_dtype"] == ran["param_dtype"] == "torch.bfloat16"
        assert ran["optimizer_steps"] * 2 == ran["micro_steps"] == (8 if run == "loop" else 4)
        if run == "loop":  # 64 samples, 4 a batch, on 2 ranks; the Trainer accumulates by itself
            assert ran["accelerator_accumulation"] == 2
