"""The DeepSpeed `optimizer` / `scheduler` blocks: validation messages, built objects, and schedule values.

Expected learning rates are the documented closed forms, written out per step. `k` counts `scheduler.step()` calls;
DeepSpeed's iteration is `i = k - 1` (see [Note: step counting] in `accelerate_zero/optim/lr_schedules.py`).
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from accelerate_zero.optim import lr_schedules
from accelerate_zero.optim.factory import (
    MAX_GRAD_NORM_ERROR,
    build_lr_scheduler,
    build_optimizer,
    optimizer_block_errors,
    scheduler_block_errors,
)


def _params(count: int = 1) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(7, 15)) for _ in range(count)]


def _sgd(*group_lrs: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": [p], "lr": lr} for p, lr in zip(_params(len(group_lrs)), group_lrs, strict=True)]
    )


def _lr_trajectory(optimizer: torch.optim.Optimizer, scheduler: object, steps: int) -> list[list[float]]:
    """Each group's lr after construction (k = 0) and after each of `steps` optimizer + scheduler steps."""
    lrs = [[group["lr"] for group in optimizer.param_groups]]
    for _ in range(steps):
        optimizer.step()  # no grads: a no-op, but keeps torch's "scheduler stepped first" check quiet
        scheduler.step()
        lrs.append([group["lr"] for group in optimizer.param_groups])
    return lrs


# ---------------------------------------------------------------------------------------------------------------
# build_optimizer


def test_adam_builds_adamw_with_deepspeed_weight_decay_default() -> None:
    optimizer = build_optimizer(_params(), "Adam", {"lr": 0.02, "betas": [0.8, 0.95], "eps": 1e-6})
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["lr"] == 0.02
    assert tuple(optimizer.defaults["betas"]) == (0.8, 0.95)
    assert optimizer.defaults["eps"] == 1e-6
    # DeepSpeed's own Adam kernels default weight_decay to 0, not AdamW's 0.01.
    assert optimizer.defaults["weight_decay"] == 0.0


def test_adam_w_mode_false_builds_adam() -> None:
    optimizer = build_optimizer(_params(), "Adam", {"lr": 0.003, "adam_w_mode": False, "weight_decay": 0.1})
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.defaults["weight_decay"] == 0.1
    assert optimizer.defaults["decoupled_weight_decay"] is False


def test_adamw_ignores_adam_w_mode_false() -> None:
    # DeepSpeed: the AdamW type is always decoupled; adam_w_mode only changes "Adam".
    optimizer = build_optimizer(_params(), "AdamW", {"lr": 0.001, "adam_w_mode": False})
    assert type(optimizer) is torch.optim.AdamW


def test_torch_adam_keeps_torch_weight_decay_default() -> None:
    optimizer = build_optimizer(_params(), "Adam", {"lr": 0.001, "torch_adam": True})
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["weight_decay"] == 0.01
    explicit = build_optimizer(_params(), "AdamW", {"lr": 0.001, "weight_decay": 0.05, "bias_correction": True})
    assert explicit.defaults["weight_decay"] == 0.05


@pytest.mark.parametrize(
    ("type_name", "params", "expected_class", "expected_defaults"),
    [
        ("adamw", {"lr": 0.5}, torch.optim.AdamW, {"lr": 0.5}),
        ("ADAM", {"lr": 0.5, "adam_w_mode": False}, torch.optim.Adam, {"lr": 0.5}),
        ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}, torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
        ("adagrad", {"lr": 0.2}, torch.optim.Adagrad, {"lr": 0.2}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        ("sgd", {"lr": 0.3}, torch.optim.SGD, {"lr": 0.3, "momentum": 0}),
        ("RMSprop", {"lr": 0.01, "alpha": 0.9}, torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9}),
    ],
)
def test_each_type_builds_its_class(
    type_name: str, params: dict, expected_class: type, expected_defaults: dict[str, object]
) -> None:
    optimizer = build_optimizer(_params(), type_name, params)
    assert type(optimizer) is expected_class
    for key, value in expected_defaults.items():
        assert optimizer.defaults[key] == value


def test_param_group_dicts_keep_their_settings() -> None:
    first, second = _params(2)
    groups = [{"params": [first], "weight_decay": 0.0}, {"params": [second], "lr": 0.5}]
    optimizer = build_optimizer(groups, "AdamW", {"lr": 0.1, "weight_decay": 0.01})
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.5]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.0, 0.01]


def test_build_optimizer_refuses_leftover_auto_and_lists_every_problem() -> None:
    with pytest.raises(ValueError) as raised:
        build_optimizer(_params(), "AdamW", {"lr": "auto", "max_grad_norm": 1.0, "betaz": [0.9, 0.99]})
    message = str(raised.value)
    assert "optimizer.params.lr is still 'auto'" in message
    assert MAX_GRAD_NORM_ERROR in message
    assert "optimizer.params.betaz is not a parameter of AdamW (torch.optim.AdamW); did you mean 'betas'?" in message


# ---------------------------------------------------------------------------------------------------------------
# optimizer_block_errors


def test_valid_optimizer_blocks_have_no_errors() -> None:
    assert optimizer_block_errors("Adam", {"lr": 1e-3, "betas": [0.9, 0.999], "torch_adam": True}) == []
    assert optimizer_block_errors("SGD", {"lr": 0.1, "momentum": 0.9}) == []


def test_auto_values_are_not_checked() -> None:
    params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    assert optimizer_block_errors("AdamW", params) == []


def test_unknown_optimizer_type_names_closest_match_and_supported_types() -> None:
    (error,) = optimizer_block_errors("Adamx", {})
    assert error.startswith("optimizer.type 'Adamx' is not a known optimizer; did you mean 'Adamax'?")
    assert "Supported types: " in error and "AdamW" in error and "SGD" in error
    assert "Muon" in error  # built from torch's Muon and AdamW (optim/muon.py)
    assert "LBFGS" not in error and "SparseAdam" not in error  # refused by name, so not offered


def test_unknown_optimizer_param() -> None:
    assert optimizer_block_errors("SGD", {"lr": 0.1, "momentun": 0.9}) == [
        "optimizer.params.momentun is not a parameter of SGD (torch.optim.SGD); did you mean 'momentum'? "
        "Accepted: dampening, differentiable, foreach, fused, lr, maximize, momentum, nesterov, weight_decay."
    ]


def test_adam_only_keys_are_unknown_elsewhere() -> None:
    (error,) = optimizer_block_errors("Adagrad", {"torch_adam": True})
    assert error.startswith("optimizer.params.torch_adam is not a parameter of Adagrad (torch.optim.Adagrad).")


def test_max_grad_norm_is_refused_with_deepspeed_wording() -> None:
    assert optimizer_block_errors("AdamW", {"lr": 1e-3, "max_grad_norm": 1.0}) == [
        "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the top-level config "
        "parameter 'gradient_clipping'"
    ]


@pytest.mark.parametrize(
    ("type_name", "alternative"),
    [
        ("Lamb", "torch.optim.AdamW"),
        ("OneBitAdam", "torch.optim.AdamW"),
        ("ZeroOneAdam", "torch.optim.AdamW"),
        ("onebitlamb", "torch.optim.AdamW"),
        ("MuAdam", "torch.optim.Adam"),
        ("MuAdamW", "torch.optim.AdamW"),
        ("MuSGD", "torch.optim.SGD"),
        ("Lion", "torch.optim.AdamW"),
    ],
)
def test_deepspeed_only_types_are_refused_with_a_torch_alternative(type_name: str, alternative: str) -> None:
    (error,) = optimizer_block_errors(type_name, {"lr": 1e-3})
    assert error.startswith(f"optimizer type {type_name!r} is DeepSpeed-only: ")
    assert alternative in error
    with pytest.raises(ValueError, match="DeepSpeed-only"):
        build_optimizer(_params(), type_name, {"lr": 1e-3})


def test_value_types_are_checked() -> None:
    errors = optimizer_block_errors(
        "Adam", {"lr": "1e-3", "betas": [0.9], "amsgrad": "yes", "adam_w_mode": 0, "bias_correction": False}
    )
    assert errors == [
        "optimizer.params.adam_w_mode must be true or false, got 0 (int)",
        "optimizer.params.bias_correction can only be true: torch's Adam and AdamW always correct the bias; "
        "remove the key",
        "optimizer.params.amsgrad must be true or false, got 'yes' (str)",
        "optimizer.params.betas must be a list of 2 numbers, got [0.9] (list)",
        "optimizer.params.lr must be a number, got '1e-3' (str): write the number without quotes",
    ]
    assert optimizer_block_errors("SGD", {"lr": True}) == ["optimizer.params.lr must be a number, got True (bool)"]


# ---------------------------------------------------------------------------------------------------------------
# scheduler_block_errors and torch schedulers


def test_valid_scheduler_blocks_have_no_errors() -> None:
    assert scheduler_block_errors("WarmupLR", {"warmup_num_steps": 10, "warmup_type": "linear"}) == []
    assert scheduler_block_errors("WarmupCosineLR", {"total_num_steps": 100}) == []
    assert scheduler_block_errors("warmupdecaylr", {"total_num_steps": 10, "warmup_max_lr": [0.1, 0.2]}) == []


def test_scheduler_auto_values_are_not_checked() -> None:
    params = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}
    assert scheduler_block_errors("WarmupDecayLR", params) == []
    with pytest.raises(ValueError, match="scheduler.params.total_num_steps is still 'auto'"):
        build_lr_scheduler(_sgd(0.1), "WarmupDecayLR", params)


def test_scheduler_errors() -> None:
    assert scheduler_block_errors("WarmupDecayLR", {"warmup_num_steps": 0, "warmup_type": "cosine", "warmup": 5}) == [
        "scheduler.params.warmup is not a parameter of WarmupDecayLR; did you mean 'warmup_type'? Accepted: "
        "last_batch_iteration, total_num_steps, warmup_max_lr, warmup_min_lr, warmup_num_steps, warmup_type.",
        "scheduler.params.warmup_num_steps must be a positive integer, got 0 (int)",
        "scheduler.params.warmup_type must be one of ('log', 'linear'), got 'cosine' (str)",
        "scheduler.params is missing 'total_num_steps', which WarmupDecayLR requires",
    ]
    assert scheduler_block_errors("OneCycle", {"cycle_min_lr": [0.1, "x"], "cycle_max_lr": 1.0}) == [
        "scheduler.params.cycle_min_lr must be a number or a list of numbers (one per param group), "
        "got [0.1, 'x'] (list)"
    ]


def test_unknown_scheduler_type_names_closest_match() -> None:
    (error,) = scheduler_block_errors("WarmpLR", {})
    assert error.startswith("scheduler.type 'WarmpLR' is not a known scheduler; did you mean 'WarmupLR'?")
    assert "OneCycleLR" in error and "LambdaLR" not in error


@pytest.mark.parametrize("type_name", ["LambdaLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"])
def test_schedulers_a_config_cannot_build_are_refused(type_name: str) -> None:
    (error,) = scheduler_block_errors(type_name, {})
    assert error.startswith(f"scheduler type {type_name!r} cannot be built from a config: ")


def test_torch_scheduler_params_are_checked_against_its_signature() -> None:
    assert scheduler_block_errors("StepLR", {"gama": 0.5}) == [
        "scheduler.params.gama is not a parameter of StepLR (torch.optim.lr_scheduler.StepLR); did you mean "
        "'gamma'? Accepted: gamma, last_epoch, step_size.",
        "scheduler.params is missing 'step_size', which StepLR (torch.optim.lr_scheduler.StepLR) requires",
    ]


def test_other_names_build_torch_schedulers() -> None:
    optimizer = _sgd(0.8)
    scheduler = build_lr_scheduler(optimizer, "StepLR", {"step_size": 2, "gamma": 0.5})
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR
    assert [lrs[0] for lrs in _lr_trajectory(optimizer, scheduler, 5)] == [0.8, 0.8, 0.4, 0.4, 0.2, 0.2]


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed's schedules: closed-form values


def test_warmup_lr_log() -> None:
    optimizer = _sgd(0.5)
    scheduler = build_lr_scheduler(
        optimizer, "WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.11, "warmup_num_steps": 10}
    )
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    lrs = [group_lrs[0] for group_lrs in _lr_trajectory(optimizer, scheduler, 25)]
    # k = 0 (i = -1) and k = 1 (i = 0, log 1 = 0) both sit at warmup_min_lr.
    assert lrs[0] == 0.01 and lrs[1] == 0.01
    assert lrs[2] == pytest.approx(0.01 + 0.1 * math.log(2) / math.log(10))  # 0.0401030
    assert lrs[6] == pytest.approx(0.01 + 0.1 * math.log(6) / math.log(10))  # 0.0878151
    assert lrs[10] == pytest.approx(0.11)  # i = 9: log(10) / log(10)
    assert lrs[11] == lrs[25] == 0.11
    assert scheduler.last_batch_iteration == 24


def test_warmup_lr_linear_defaults_to_optimizer_lr() -> None:
    optimizer = _sgd(0.2)
    scheduler = build_lr_scheduler(optimizer, "WarmupLR", {"warmup_num_steps": 8, "warmup_type": "linear"})
    lrs = [group_lrs[0] for group_lrs in _lr_trajectory(optimizer, scheduler, 12)]
    assert lrs[:3] == [0.0, 0.0, pytest.approx(0.2 * 1 / 8)]
    assert lrs[5] == pytest.approx(0.2 * 4 / 8)  # 0.1
    assert lrs[8] == pytest.approx(0.2 * 7 / 8)  # 0.175: the last warmup step is one short of the peak
    assert lrs[9] == lrs[12] == 0.2


def test_warmup_num_steps_one_is_raised_to_two() -> None:
    optimizer = _sgd(0.3)
    scheduler = lr_schedules.WarmupLR(optimizer, warmup_num_steps=1, warmup_type="linear")
    assert scheduler.warmup_num_steps == 2
    assert [lrs[0] for lrs in _lr_trajectory(optimizer, scheduler, 3)] == [0.0, 0.0, 0.15, 0.3]
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        lr_schedules.WarmupLR(_sgd(0.3), warmup_num_steps=0)


def test_warmup_lr_per_group() -> None:
    optimizer = _sgd(0.1, 0.05)
    scheduler = build_lr_scheduler(
        optimizer, "WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_num_steps": 4, "warmup_type": "linear"}
    )
    lrs = _lr_trajectory(optimizer, scheduler, 6)
    assert lrs[0] == [0.0, 0.01]
    assert lrs[3] == [pytest.approx(0.1 * 2 / 4), pytest.approx(0.01 + 0.04 * 2 / 4)]  # [0.05, 0.03]
    assert lrs[6] == [0.1, 0.05]
    with pytest.raises(ValueError, match="warmup_min_lr has 3 values but the optimizer has 2 param groups"):
        build_lr_scheduler(_sgd(0.1, 0.05), "WarmupLR", {"warmup_min_lr": [0.0, 0.0, 0.0]})


def test_warmup_decay_lr() -> None:
    optimizer = _sgd(0.5)
    params = {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_min_lr": 0.01, "warmup_max_lr": 0.21}
    scheduler = build_lr_scheduler(optimizer, "WarmupDecayLR", {**params, "warmup_type": "linear"})
    lrs = [group_lrs[0] for group_lrs in _lr_trajectory(optimizer, scheduler, 45)]
    assert lrs[10] == pytest.approx(0.01 + 0.2 * 9 / 10)  # i = 9, last warmup step: 0.19
    assert lrs[11] == pytest.approx(0.21)  # i = 10: (30 - 10) / 20 = 1
    assert lrs[21] == pytest.approx(0.01 + 0.2 * 10 / 20)  # i = 20: 0.11
    assert lrs[31] == lrs[45] == 0.01  # i >= 30: the decay has reached warmup_min_lr and stays there


def test_warmup_decay_lr_defaults() -> None:
    optimizer = _sgd(0.5)
    scheduler = build_lr_scheduler(optimizer, "WarmupDecayLR", {"total_num_steps": 3000})
    # DeepSpeed 0.19 keeps warmup_max_lr = 0.001 for WarmupDecayLR (only WarmupLR defaults to the optimizer's lr).
    assert (scheduler.min_lrs, scheduler.max_lrs, scheduler.warmup_num_steps) == ([0.0], [0.001], 1000)
    lrs = [group_lrs[0] for group_lrs in _lr_trajectory(optimizer, scheduler, 100)]
    assert lrs[100] == pytest.approx(0.001 * math.log(100) / math.log(1000))  # i = 99: 0.000666667


def test_warmup_cosine_lr() -> None:
    optimizer = _sgd(0.2, 0.4)
    params = {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}
    scheduler = build_lr_scheduler(optimizer, "WarmupCosineLR", {**params, "warmup_type": "linear"})
    lrs = _lr_trajectory(optimizer, scheduler, 40)
    assert lrs[0] == [0.0, 0.0]  # before the first step
    assert lrs[1] == [pytest.approx(0.02), pytest.approx(0.04)]  # i = 0: warmup_min_ratio
    assert lrs[6] == [pytest.approx(0.2 * 0.55), pytest.approx(0.4 * 0.55)]  # i = 5: 0.1 + 0.9 * 5/10
    assert lrs[11][0] == pytest.approx(0.2 * (0.01 + 0.99 * (1 + math.cos(math.pi / 20)) / 2))  # i = 10
    assert lrs[20] == [pytest.approx(0.2 * 0.505), pytest.approx(0.4 * 0.505)]  # i = 19: half way down
    assert lrs[30] == [pytest.approx(0.002), pytest.approx(0.004)]  # i = 29: cos_min_ratio
    assert lrs[40] == lrs[30]  # held at the floor after total_num_steps


def test_warmup_cosine_lr_log_warmup() -> None:
    optimizer = _sgd(1.0)
    scheduler = build_lr_scheduler(optimizer, "WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 5})
    lrs = [group_lrs[0] for group_lrs in _lr_trajectory(optimizer, scheduler, 5)]
    assert lrs == [0.0, 0.0, pytest.approx(math.log(2) / math.log(5)), pytest.approx(math.log(3) / math.log(5)),
                   pytest.approx(math.log(4) / math.log(5)), pytest.approx(1.0)]  # fmt: skip


def test_lr_range_test() -> None:
    optimizer = _sgd(0.5, 0.5)
    params = {"lr_range_test_min_lr": [0.01, 0.02], "lr_range_test_step_size": 4, "lr_range_test_step_rate": 0.5}
    lrs = _lr_trajectory(optimizer, build_lr_scheduler(optimizer, "LRRangeTest", params), 8)
    assert lrs[0] == [0.01, 0.02]
    assert lrs[2] == [pytest.approx(0.01 * (1 + 0.5 * 2 / 4)), pytest.approx(0.02 * 1.25)]  # i = 1
    stairs_optimizer = _sgd(0.5)
    stairs = lr_schedules.LRRangeTest(stairs_optimizer, 0.01, lr_range_test_step_size=4, lr_range_test_staircase=True)
    expected = [0.01] * 4 + [0.02] * 4 + [0.03]  # k // 4 whole stairs
    assert [lrs[0] for lrs in _lr_trajectory(stairs_optimizer, stairs, 8)] == pytest.approx(expected)


def test_one_cycle_lr_and_momentum() -> None:
    optimizer = torch.optim.AdamW(_params(), lr=0.5, betas=(0.9, 0.999))
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.11, "cycle_first_step_size": 4, "cycle_second_step_size": 2}
    scheduler = build_lr_scheduler(optimizer, "OneCycle", {**params, "decay_step_size": 2, "decay_lr_rate": 0.5})
    lrs, betas = [], []
    for _ in range(9):
        lrs.append(optimizer.param_groups[0]["lr"])
        betas.append(optimizer.param_groups[0]["betas"])
        optimizer.step()
        scheduler.step()
    # Up over 4 steps (u = i + 1 = 0..4), down over 2 (u = 5, 6), then lr = min / (1 + 0.5 * (u - 6) / 2).
    expected_lrs = [0.01, 0.035, 0.06, 0.085, 0.11, 0.06, 0.01, 0.01 / 1.25, 0.01 / 1.5]
    assert lrs == [pytest.approx(lr) for lr in expected_lrs]
    # DeepSpeed's quirks: beta1 starts at cycle_min_mom and beta2 becomes 0.99.
    assert betas[0] == (0.8, 0.99)
    # Then beta1 = max_mom - (max_mom - min_mom) * scale, mirroring the lr; no momentum decay after the cycle.
    assert [beta1 for beta1, _ in betas[1:9]] == pytest.approx([0.875, 0.85, 0.825, 0.8, 0.85, 0.9, 0.9, 0.9])


def test_one_cycle_leaves_sgd_momentum_alone() -> None:
    optimizer = torch.optim.SGD(_params(), lr=0.5, momentum=0.7)
    scheduler = lr_schedules.OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=0.3, cycle_first_step_size=2)
    lrs = _lr_trajectory(optimizer, scheduler, 5)
    assert [group_lrs[0] for group_lrs in lrs] == pytest.approx([0.1, 0.2, 0.3, 0.2, 0.1, 0.1])
    assert optimizer.param_groups[0]["momentum"] == 0.7 and "betas" not in optimizer.param_groups[0]


# ---------------------------------------------------------------------------------------------------------------
# Checkpointing


@pytest.mark.parametrize(
    ("type_name", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 6}),
        ("WarmupDecayLR", {"total_num_steps": 15, "warmup_num_steps": 5, "warmup_max_lr": None}),
        ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 5, "warmup_type": "linear"}),
        ("LRRangeTest", {"lr_range_test_step_size": 3}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}),
    ],
)
def test_state_dict_round_trip_continues_identically(type_name: str, params: dict) -> None:
    original_optimizer = torch.optim.AdamW(_params(), lr=0.1)
    original = build_lr_scheduler(original_optimizer, type_name, params)
    _lr_trajectory(original_optimizer, original, 7)
    buffer = io.BytesIO()
    torch.save({"scheduler": original.state_dict(), "optimizer": original_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed_optimizer = torch.optim.AdamW(_params(), lr=0.1)
    resumed = build_lr_scheduler(resumed_optimizer, type_name, params)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    resumed.load_state_dict(checkpoint["scheduler"])
    assert resumed.last_batch_iteration == original.last_batch_iteration == 6
    assert _lr_trajectory(resumed_optimizer, resumed, 10) == _lr_trajectory(original_optimizer, original, 10)
    assert resumed_optimizer.param_groups[0]["betas"] == original_optimizer.param_groups[0]["betas"]


def test_loads_deepspeed_scheduler_state() -> None:
    optimizer = _sgd(0.4)
    scheduler = build_lr_scheduler(optimizer, "WarmupLR", {"warmup_num_steps": 10, "warmup_type": "linear"})
    scheduler.load_state_dict({"last_batch_iteration": 4})
    optimizer.step()
    scheduler.step()
    assert scheduler.last_batch_iteration == 5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 5 / 10)


def test_last_batch_iteration_resumes_mid_schedule() -> None:
    optimizer = _sgd(0.4)
    params = {"warmup_num_steps": 10, "warmup_type": "linear", "last_batch_iteration": 4}
    scheduler = build_lr_scheduler(optimizer, "WarmupLR", params)
    assert scheduler.last_batch_iteration == 4
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 4 / 10)
