"""resolve_config: unfilled "auto", DeepSpeed's batch rule, stage-dependent rules; and the validate CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelerate_zero.cli.main import main
from accelerate_zero.config import AUTO, ZeroConfig, ZeroConfigError, resolve_config


def resolve(raw: dict, world_size: int = 1) -> ZeroConfig:
    return resolve_config(ZeroConfig.from_any(raw), world_size=world_size)


def resolve_problems(raw: dict, world_size: int = 1) -> list[str]:
    with pytest.raises(ZeroConfigError) as info:
        resolve(raw, world_size)
    return info.value.problems


def batch(cfg: ZeroConfig) -> tuple[int | None, int | None, int | None]:
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


# ---- batch rule --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            4,
            (32, 4, 2),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
        ({"gradient_accumulation_steps": 6}, 2, (None, None, 6)),  # differs from DeepSpeed on purpose
        ({}, 2, (None, None, 1)),  # differs from DeepSpeed on purpose
    ],
)
def test_batch_rule_infers_the_missing_value(given: dict, world_size: int, expected: tuple) -> None:
    assert batch(resolve(given, world_size)) == expected


def test_batch_mismatch_message_shows_the_factors_and_product() -> None:
    raw = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    assert resolve_problems(raw, world_size=2) == [
        "train_batch_size=32 != train_micro_batch_size_per_gpu=4 * gradient_accumulation_steps=2 * world_size=2 "
        "(= 16): fix one of them or set train_batch_size to 'auto'"
    ]


def test_batch_that_cannot_be_divided_names_the_missing_value() -> None:
    assert resolve_problems({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, world_size=1) == [
        "train_batch_size=10 is not divisible by train_micro_batch_size_per_gpu=4 * world_size=1 (= 4), so "
        "gradient_accumulation_steps cannot be inferred: fix one of them or set train_batch_size to 'auto'"
    ]


def test_batch_values_must_be_positive() -> None:
    assert resolve_problems({"train_micro_batch_size_per_gpu": 0, "gradient_accumulation_steps": -1}) == [
        "train_micro_batch_size_per_gpu=0: must be > 0",
        "gradient_accumulation_steps=-1: must be > 0",
    ]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ZeroConfigError, match=r"world_size=0: must be a positive integer"):
        resolve({}, world_size=0)


# ---- "auto" ------------------------------------------------------------------------------------------------------


def test_unfilled_auto_values_are_listed_one_per_line() -> None:
    """DeepSpeed uses a top-level or optimizer "auto" as the string itself (it would fail): an error here."""
    raw = {"gradient_clipping": AUTO, "optimizer": {"type": "AdamW", "params": {"lr": AUTO}}}
    assert resolve_problems(raw) == [
        '"gradient_clipping" is "auto" and nothing filled it: replace "auto" with a value, or let the '
        "Trainer/accelerate integration fill it (ZeroConfig.fill_auto)",
        '"optimizer.params.lr" is "auto" and nothing filled it: replace "auto" with a value, or let '
        "the Trainer/accelerate integration fill it (ZeroConfig.fill_auto)",
    ]


def test_unfilled_autos_of_deepspeeds_pydantic_blocks_take_the_default_with_a_note(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DeepSpeed's pydantic blocks drop an "auto" nothing filled (OpenRLHF's `"sub_group_size": "auto"`)."""
    raw = {
        "zero_optimization": {"stage": 3, "sub_group_size": AUTO, "stage3_prefetch_bucket_size": AUTO},
        "fp16": {"enabled": AUTO},
    }
    with caplog.at_level("WARNING", logger="accelerate_zero"):
        resolved = resolve(raw)
    assert resolved.zero_optimization.sub_group_size == 1_000_000_000
    assert resolved.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert resolved.fp16.enabled is False
    assert (
        'zero_optimization.sub_group_size is "auto" and nothing filled it: it takes the default 1000000000, as '
        "in DeepSpeed" in caplog.text
    )


def test_auto_batch_sizes_are_reported_once_not_as_a_batch_mismatch() -> None:
    problems = resolve_problems({"train_batch_size": AUTO, "train_micro_batch_size_per_gpu": 3})
    assert len(problems) == 1 and problems[0].startswith('"train_batch_size" is "auto"')


def test_stage3_autos_below_stage_3_take_the_default() -> None:
    raw = {
        "zero_optimization": {
            "stage": 2,
            "stage3_prefetch_bucket_size": AUTO,
            "stage3_param_persistence_threshold": AUTO,
        }
    }
    zero = resolve(raw).zero_optimization
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (50_000_000, 100_000)


def test_filled_reference_style_config_resolves() -> None:
    cfg = ZeroConfig.from_any(
        {
            "train_batch_size": AUTO,
            "train_micro_batch_size_per_gpu": AUTO,
            "gradient_accumulation_steps": AUTO,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": AUTO},
        }
    )
    filled = cfg.fill_auto(
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "zero_optimization.reduce_bucket_size": 4096 * 4096,
        }
    )
    resolved = resolve_config(filled, world_size=2)
    assert batch(resolved) == (16, 2, 4)
    assert resolved.zero_optimization.reduce_bucket_size == 16_777_216
    assert resolved.zero_optimization.overlap_comm is True
    assert resolved.auto_keys() == []


def test_resolve_does_not_modify_its_input() -> None:
    cfg = ZeroConfig.from_any({"train_micro_batch_size_per_gpu": 2})
    resolve_config(cfg, world_size=4)
    assert batch(cfg) == (None, 2, None) and cfg.zero_optimization.overlap_comm is None


# ---- stage-dependent rules ---------------------------------------------------------------------------------------


def test_param_offload_needs_stage_3() -> None:
    assert resolve_problems({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}) == [
        "zero_optimization.offload_param.device='cpu' needs zero_optimization.stage=3 (got 2): parameter offload only "
        "exists at stage 3; set stage to 3 or remove offload_param"
    ]
    assert (
        resolve({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}}).zero_optimization.stage == 2
    )


def test_nvme_offload_needs_a_path() -> None:
    raw = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}
    }
    assert resolve_problems(raw) == [
        "zero_optimization.offload_param.device is 'nvme' but zero_optimization.offload_param.nvme_path is not set: "
        "set it to a folder on a fast local disk",
        "zero_optimization.offload_optimizer.device is 'nvme' but zero_optimization.offload_optimizer.nvme_path is "
        "not set: set it to a folder on a fast local disk",
    ]
    raw["zero_optimization"]["offload_param"]["nvme_path"] = "/local_nvme"
    raw["zero_optimization"]["offload_optimizer"]["nvme_path"] = Path("/local_nvme")
    assert resolve(raw).zero_optimization.offload_optimizer.nvme_path == "/local_nvme"


def test_resolve_reports_every_problem_together() -> None:
    raw = {
        "gradient_clipping": AUTO,
        "train_batch_size": 7,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1, "offload_param": {"device": "nvme"}},
    }
    problems = resolve_problems(raw, world_size=2)
    assert [p.split(" ")[0] for p in problems] == [
        '"gradient_clipping"',
        "train_batch_size=7",
        "zero_optimization.offload_param.device='nvme'",
        "zero_optimization.offload_param.device",
    ]


# ---- validate CLI ------------------------------------------------------------------------------------------------


def test_validate_prints_the_resolved_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}))
    assert main(["validate", str(path), "--world_size", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train_batch_size"] == 8 and out["gradient_accumulation_steps"] == 1
    assert out["zero_optimization"]["overlap_comm"] is True


def test_validate_reports_problems_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("zero_optimization:\n  stage: 9\n  reduce_bucket_sz: 1\ngradient_clipping: auto\n")
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"accelerate-zero: invalid ZeRO config {path}:",
        "  - unknown key 'zero_optimization.reduce_bucket_sz' (did you mean 'reduce_bucket_size'?): remove it or fix "
        "its spelling",
        "  - zero_optimization.stage=9: expected an integer in [0, 3]",
    ]
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("name", ["missing.json", "notes.txt"])
def test_validate_unreadable_file_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    assert main(["validate", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"accelerate-zero: invalid ZeRO config {tmp_path / name}:\n  - ")
    assert "Traceback" not in err


def test_validate_reports_unfilled_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auto.json"
    path.write_text(json.dumps({"gradient_clipping": "auto"}))
    assert main(["validate", str(path)]) == 0  # the Trainer / ZeroAccelerator fill it: reported, not refused
    assert "gradient_clipping" in capsys.readouterr().err


def test_a_resolved_config_cannot_hold_auto_or_unset_values() -> None:
    from accelerate_zero.config import ResolvedZeroConfig

    resolved = resolve_config(ZeroConfig.from_any({"zero_optimization": {"stage": 2}}), world_size=2)
    assert isinstance(resolved, ResolvedZeroConfig) and resolved.auto_keys() == []
    assert resolved.gradient_accumulation_steps == 1 and resolved.zero_optimization.overlap_comm is True
    with pytest.raises(ZeroConfigError, match='optimizer.params.lr is still "auto"'):
        ResolvedZeroConfig.from_any({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    with pytest.raises(ZeroConfigError, match="overlap_comm is unset"):
        ResolvedZeroConfig.from_any({"gradient_accumulation_steps": 1})
    assert resolve_config(resolved, world_size=2) == resolved  # resolving again changes nothing


def test_the_engine_refuses_an_unresolved_config() -> None:
    import torch

    from accelerate_zero.engine.engine import ZeroEngine
    from accelerate_zero.engine.groups import DataParallelGroup

    with pytest.raises(TypeError, match="ResolvedZeroConfig"):
        ZeroEngine(
            torch.nn.Linear(2, 2),
            None,
            ZeroConfig.from_any({}),
            None,
            dp=DataParallelGroup(group=None, rank=0, world_size=1),
            device=torch.device("cpu"),
        )
