"""`TrainingArguments(zero_config=...)`: the "auto" table transformers applies to DeepSpeed configs, its mismatch
error, the command line, the launcher's config, and which checkpoints count as complete."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from accelerate_zero import TrainingArguments
from accelerate_zero.integrations.transformers.auto_values import fill_from_model, fill_from_training_args
from accelerate_zero.integrations.transformers.trainer import last_complete_checkpoint


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _args(tmp_path: Path, **kwargs: object) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def _model(hidden: int = 64) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))


def test_transformers_zero2_config_is_filled_from_the_arguments(tmp_path: Path) -> None:
    args = _args(
        tmp_path,
        zero_config=str(FIXTURES / "ds_config_zero2.json"),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
        learning_rate=2e-4,
        adam_beta1=0.85,
        weight_decay=0.01,
        max_grad_norm=0.7,
        bf16=True,
        warmup_steps=5,
    )
    config = args.zero_fill.config
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 12 and config["gradient_clipping"] == 0.7
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.85, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": "auto"}
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is True
    fill_from_model(args.zero_fill, args, _model(64), num_training_steps=100)
    assert config["scheduler"]["params"]["warmup_num_steps"] == 5
    assert config["zero_optimization"]["reduce_bucket_size"] == 2e8  # written, not "auto": kept


def test_hidden_size_autos_and_step_counts(tmp_path: Path) -> None:
    raw = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    }
    args = _args(tmp_path, zero_config=raw, warmup_steps=0)
    fill_from_model(args.zero_fill, args, _model(48), num_training_steps=30)
    zero = args.zero_fill.config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (48 * 48, int(0.9 * 48 * 48))
    assert zero["stage3_param_persistence_threshold"] == 480
    assert args.zero_fill.config["scheduler"]["params"] == {"total_num_steps": 30, "warmup_num_steps": 1}
    with pytest.raises(ValueError, match=r"neither `hidden_size` nor `hidden_sizes`.*'zero_optimization.reduce"):
        fill_from_model(fill_from_training_args(raw, args), args, SimpleNamespace(config=SimpleNamespace()), 30)


def test_every_mismatch_in_one_error_worded_as_transformers(tmp_path: Path) -> None:
    raw = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": "8",  # a numeric string equal to the argument is not a mismatch
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2},
    }
    args = _args(tmp_path, zero_config=raw, per_device_train_batch_size=2, gradient_accumulation_steps=8)
    with pytest.raises(ValueError) as error:
        fill_from_model(args.zero_fill, args, _model(), num_training_steps=260)
    assert str(error.value) == (
        "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
        "- ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=2\n"
        "- ds optimizer.params.lr=0.001 vs hf learning_rate=5e-05\n"
        "- ds scheduler.params.total_num_steps=10 vs hf num_training_steps (calculated)=260\n"
        "The easiest method is to set these DeepSpeed config values to 'auto'."
    )


def test_command_line_and_deepspeed_argument(tmp_path: Path) -> None:
    from transformers import HfArgumentParser

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--zero_config", str(path), "--use_cpu", "--report_to", "none"]
    )
    assert args.zero_stage == 3 and args.place_model_on_device is False
    assert _args(tmp_path, deepspeed=str(path)).zero_stage == 3  # read as zero_config (issue 17)


def test_launcher_config_is_used_when_the_script_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}}
    monkeypatch.setenv("ACCELERATE_ZERO_CONFIG", json.dumps(launched))
    args = _args(tmp_path, per_device_train_batch_size=5)
    assert args.zero_stage == 1 and args.zero_fill.config["train_micro_batch_size_per_gpu"] == 5
    script = _args(tmp_path, zero_config={"zero_optimization": {"stage": 1, "reduce_bucket_size": 10}})
    assert script.zero_fill.config["zero_optimization"]["reduce_bucket_size"] == 10  # the script's, agreeing
    with pytest.raises(ValueError, match="zero_optimization.stage=3 vs launcher zero_optimization.stage=1"):
        _args(tmp_path, zero_config={"zero_optimization": {"stage": 3}})  # two sources that disagree


def test_bad_config_fails_when_the_arguments_are_made(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        _args(tmp_path, zero_config={"zero_optimization": {"stage": 5}})


def test_last_complete_checkpoint_skips_a_save_that_did_not_finish(tmp_path: Path) -> None:
    for step, state in ((2, "{}"), (4, "{}"), (6, '{"truncat')):
        folder = tmp_path / f"checkpoint-{step}"
        (folder / "zero_model").mkdir(parents=True)
        (folder / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-8" / "zero_model").mkdir(parents=True)  # killed before trainer_state.json
    (tmp_path / "checkpoint-4" / ".zero_model.partial").mkdir()  # killed while re-writing the engine state
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")


def _launched_env(*flags: str) -> dict[str, str]:
    """What `accelerate-zero launch <flags> train.py` exports to its ranks (no accelerate config file)."""
    import argparse

    from accelerate_zero.cli import launch
    from accelerate_zero.integrations.accelerate.launcher import prepare_launch

    parser = argparse.ArgumentParser()
    launch.register(parser.add_subparsers())
    args = parser.parse_args(["launch", "--config_file", os.devnull, "--num_processes", "2", *flags, "train.py"])
    args.config_file = None  # no accelerate config: the flags alone
    return prepare_launch(args).env


@pytest.mark.parametrize("flags", [(), ("--zero_stage", "3")])
def test_launcher_defaults_nobody_set_do_not_contradict_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    # `accelerate-zero launch --num_processes 2 train.py` fills accelerate's defaults (stage 2, no offload, no
    # 16-bit save); transformers' zero3 config differs on each, and nobody wrote the launcher's values.
    for name, value in _launched_env(*flags).items():
        monkeypatch.setenv(name, value)
    args = _args(tmp_path, zero_config=str(FIXTURES / "ds_config_zero3.json"), fp16=False)
    zero = args.zero_fill.config["zero_optimization"]
    assert args.zero_stage == 3 and zero["offload_param"]["device"] == "cpu"
    assert zero["stage3_gather_fp16_weights_on_model_save"] is True  # the old name of the 16-bit save key


def test_a_launcher_flag_the_user_set_still_contradicts_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in _launched_env("--zero_stage", "2", "--offload_param_device", "none").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:
        _args(tmp_path, zero_config=str(FIXTURES / "ds_config_zero3.json"), fp16=False)
    assert "zero_optimization.stage=3 vs launcher zero_optimization.stage=2" in str(raised.value)
    assert "offload_param.device='cpu' vs launcher zero_optimization.offload_param.device='none'" in str(raised.value)


@pytest.mark.parametrize(
    ("flags", "arguments", "expected"),
    [
        (("--mixed_precision", "no"), {"bf16": True}, (False, True)),  # `accelerate config` writes 'no'
        ((), {"fp16": True}, (True, False)),  # the launcher set no precision at all
        (("--mixed_precision", "bf16"), {}, (False, True)),  # the arguments set none: the launcher's stands
        (("--mixed_precision", "bf16"), {"fp16": True}, (True, False)),  # the arguments' wins
    ],
)
def test_the_scripts_precision_wins_over_the_launchers_mixed_precision(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
    arguments: dict[str, bool],
    expected: tuple[bool, bool],
) -> None:
    # transformers makes TrainingArguments(bf16=True/fp16=True) the run's mixed precision whatever
    # ACCELERATE_MIXED_PRECISION says (DeepSpeedPlugin.set_mixed_precision(args.mixed_precision)); before, this
    # was refused: "ds bf16.enabled=False vs hf bf16|bf16_full_eval=True".
    for name, value in _launched_env("--zero_stage", "2", *flags).items():
        monkeypatch.setenv(name, value)
    fill = _args(tmp_path, **arguments).zero_fill
    assert (fill.config["fp16"]["enabled"], fill.config["bf16"]["enabled"]) == expected and not fill.mismatches


def test_a_launcher_config_files_precision_still_contradicts_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    for name, value in _launched_env("--deepspeed_config_file", str(ds_file)).items():
        monkeypatch.setenv(name, value)
    fill = _args(tmp_path).zero_fill
    assert fill.config["bf16"]["enabled"] is True and not fill.mismatches  # the file's; the script sets none
    # The file's bf16 block is the user's choice: a script asking for fp16 is a real conflict (reported at train).
    assert "- ds bf16.enabled=True vs hf bf16|bf16_full_eval=False" in _args(tmp_path, fp16=True).zero_fill.mismatches
