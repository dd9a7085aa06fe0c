"""Optimizers and LR schedulers built from the DeepSpeed config's `optimizer` / `scheduler` blocks.

A block is `{"type": NAME, "params": {...}}`. The `*_block_errors` functions check a block before anything is built
(so a config can be validated without a model) and report every problem at once; `build_*` construct the objects.

Optimizer types follow DeepSpeed 0.19: "Adam" and "AdamW" build `torch.optim.AdamW` unless "Adam" has
`adam_w_mode: false` (then `torch.optim.Adam`), "Adagrad" builds `torch.optim.Adagrad`, "Muon" builds torch's Muon
and AdamW as DeepSpeed's block does (optim/muon.py), and any other name is a `torch.optim` class ("SGD", ...).
Optimizers that only exist inside DeepSpeed are refused with a torch alternative. Scheduler types are DeepSpeed's five (see `lr_schedules`) or a `torch.optim.lr_scheduler` class.
Type names are matched case-insensitively: DeepSpeed does so for its own names, and no torch class differs from
another only by case, so accepting "sgd" or "warmuplr" loses nothing.

[Note: Adam weight decay default]
DeepSpeed builds "Adam"/"AdamW" from its own kernels (FusedAdam, DeepSpeedCPUAdam), whose `weight_decay` defaults
to 0, and builds torch's classes only when `torch_adam: true`. `torch.optim.AdamW` defaults to 0.01. So a block
without `weight_decay` gets 0 here, except with `torch_adam: true`, where DeepSpeed too gets torch's default: the
same run therefore decays weights exactly when DeepSpeed would.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from accelerate_zero.optim import lr_schedules
from accelerate_zero.optim.kinds import refusal_of
from accelerate_zero.optim.muon import is_muon_block, muon_block_errors


AUTO = "auto"
"""A value filled later from the training arguments; the `*_block_errors` functions skip it."""

MAX_GRAD_NORM_ERROR = (
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the top-level config "
    "parameter 'gradient_clipping'"
)
"""DeepSpeed's refusal of optimizer-level clipping, kept recognisable for users coming from DeepSpeed."""

_ADAM_TYPES = ("adam", "adamw")
# DeepSpeed-only keys of its Adam types that we translate: they pick the class or restate what torch always does.
_ADAM_EXTRA_KEYS = ("adam_w_mode", "torch_adam", "bias_correction")

_USE_ADAMW = "use type 'AdamW' (torch.optim.AdamW)"
_DEEPSPEED_ONLY_OPTIMIZERS: dict[str, str] = {
    "lamb": f"it needs DeepSpeed's compiled FusedLamb op; {_USE_ADAMW}",
    "onebitadam": f"DeepSpeed's 1-bit optimizers need its compiled communication-compression ops; {_USE_ADAMW}",
    "zerooneadam": f"DeepSpeed's 0/1 Adam needs its compiled communication-compression ops; {_USE_ADAMW}",
    "onebitlamb": f"DeepSpeed's 1-bit optimizers need its compiled communication-compression ops; {_USE_ADAMW}",
    "muadam": "DeepSpeed builds it from the `mup` package; use type 'Adam' with adam_w_mode false (torch.optim.Adam), "
    "or pass a mup.MuAdam you built yourself as the optimizer",
    "muadamw": "DeepSpeed builds it from the `mup` package; use type 'AdamW' (torch.optim.AdamW), "
    "or pass a mup.MuAdamW you built yourself as the optimizer",
    "musgd": "DeepSpeed builds it from the `mup` package; use type 'SGD' (torch.optim.SGD), "
    "or pass a mup.MuSGD you built yourself as the optimizer",
    "lion": f"it needs DeepSpeed's compiled FusedLion / DeepSpeedCPULion ops and this torch has no Lion; {_USE_ADAMW}",
}

_DEEPSPEED_SCHEDULERS: dict[str, type[LRScheduler]] = {
    cls.__name__.lower(): cls
    for cls in (
        lr_schedules.WarmupLR,
        lr_schedules.WarmupDecayLR,
        lr_schedules.WarmupCosineLR,
        lr_schedules.OneCycle,
        lr_schedules.LRRangeTest,
    )
}
_PASS_YOUR_OWN = "build it in code and pass it to the engine instead of naming it in the config"
_UNBUILDABLE_SCHEDULERS: dict[str, str] = {
    "lambdalr": f"it takes a Python function, which a config cannot hold; {_PASS_YOUR_OWN}",
    "multiplicativelr": f"it takes a Python function, which a config cannot hold; {_PASS_YOUR_OWN}",
    "sequentiallr": f"it takes other scheduler objects, which a config cannot hold; {_PASS_YOUR_OWN}",
    "chainedscheduler": f"it takes other scheduler objects, which a config cannot hold; {_PASS_YOUR_OWN}",
    "reducelronplateau": "its step() needs the validation metric, but the engine steps the scheduler once per "
    f"optimizer step without one; {_PASS_YOUR_OWN} and step it yourself",
}


def optimizer_block_errors(type_name: str, params: Mapping[str, Any]) -> list[str]:
    """Returns one message per problem in an `optimizer` block (values equal to "auto" are not checked).

    Checks that the type is known and buildable, that every key of `params` is a parameter of the torch class it
    builds (DeepSpeed's `adam_w_mode`, `torch_adam` and `bias_correction: true` are accepted for "Adam"/"AdamW"),
    that `max_grad_norm` is absent, and that values have the type the class expects (numbers, booleans, pairs).

    Args:
        type_name: the block's `type`.
        params: the block's `params`.

    Returns:
        Messages, each naming the problem and its fix; empty when the block is fine.
    """
    params = params or {}
    if not isinstance(type_name, str):
        return [f"optimizer.type must be a string such as 'AdamW', got {type_name!r}"]
    refusal = _optimizer_refusal(type_name)
    if refusal is not None:
        return [f"optimizer type {type_name!r} is DeepSpeed-only: {refusal}"]
    if is_muon_block(type_name):
        return muon_block_errors(params)  # DeepSpeed's own keys, built by optim/muon.py
    cls = _optimizer_class(type_name, params)
    if cls is None:
        names = {"Adam", "AdamW", "Muon", *_torch_classes(torch.optim, Optimizer).values()}
        refused = {name for name in names if refusal_of(getattr(torch.optim, name, int)) is not None}
        known = sorted(name for name in names - refused if _optimizer_refusal(name) is None)
        return [_unknown_type_message("optimizer", type_name, known)]
    if refusal_of(cls) is not None:
        return [f"optimizer type {type_name!r} cannot train under accelerate_zero: {refusal_of(cls)}; use AdamW"]
    errors = []
    if "max_grad_norm" in params:
        errors.append(MAX_GRAD_NORM_ERROR)
    if "params" in params:
        errors.append("optimizer.params.params is not allowed: the parameters to optimize come from the model")
    is_adam = type_name.lower() in _ADAM_TYPES
    errors += _adam_extra_key_errors(params) if is_adam else []
    translated = _ADAM_EXTRA_KEYS if is_adam else ()
    checked = {key: value for key, value in params.items() if key not in ("max_grad_norm", "params")}
    errors += _signature_errors("optimizer", type_name, cls, checked, translated, _optimizer_value_check)
    return errors


def scheduler_block_errors(type_name: str, params: Mapping[str, Any]) -> list[str]:
    """Returns one message per problem in a `scheduler` block (values equal to "auto" are not checked).

    Checks that the type is one of DeepSpeed's schedules or a `torch.optim.lr_scheduler` class a config can build,
    that every key of `params` is a parameter of that class, that required parameters are present, and, for
    DeepSpeed's schedules, that values have the right type and range (per-group lists are accepted where DeepSpeed
    accepts them; their length is checked when the scheduler is built, since it depends on the optimizer).

    Args:
        type_name: the block's `type`.
        params: the block's `params`.

    Returns:
        Messages, each naming the problem and its fix; empty when the block is fine.
    """
    params = params or {}
    if not isinstance(type_name, str):
        return [f"scheduler.type must be a string such as 'WarmupLR', got {type_name!r}"]
    refusal = _UNBUILDABLE_SCHEDULERS.get(type_name.lower())
    if refusal is not None:
        return [f"scheduler type {type_name!r} cannot be built from a config: {refusal}"]
    cls = _scheduler_class(type_name)
    if cls is None:
        names = {schedule.__name__ for schedule in _DEEPSPEED_SCHEDULERS.values()}
        names |= set(_torch_classes(torch.optim.lr_scheduler, LRScheduler).values())
        known = sorted(name for name in names if name.lower() not in _UNBUILDABLE_SCHEDULERS)
        return [_unknown_type_message("scheduler", type_name, known)]
    errors = []
    if "optimizer" in params:
        errors.append("scheduler.params.optimizer is not allowed: the scheduler steps the engine's optimizer")
    value_check = _schedule_value_check if cls in _DEEPSPEED_SCHEDULERS.values() else None
    checked = {key: value for key, value in params.items() if key != "optimizer"}
    errors += _signature_errors("scheduler", type_name, cls, checked, (), value_check)
    return errors


def build_optimizer(param_groups: Iterable[Any], type_name: str, params: Mapping[str, Any]) -> torch.optim.Optimizer:
    """Builds the torch optimizer an `optimizer` block names over `param_groups`.

    Args:
        param_groups: what torch optimizers accept: an iterable of tensors or of param-group dicts.
        type_name: the block's `type`; "Adam" means AdamW unless `params` has `adam_w_mode: false`.
        params: the block's `params`, with every "auto" already filled. `torch_adam` has no effect beyond the
            weight-decay default (see [Note: Adam weight decay default]): the optimizer is always torch's.

    Returns:
        The optimizer.

    Raises:
        ValueError: the block has problems (all of them are listed) or still holds "auto" values.
    """
    params = params or {}
    if is_muon_block(type_name):
        raise ValueError(
            "optimizer type 'Muon' splits the model's parameters by name (DeepSpeed's rule): build it with "
            "accelerate_zero.optim.muon.build_muon_with_adam(model, params); the engine does so for a config block"
        )
    _raise_if_invalid("optimizer", optimizer_block_errors(type_name, params), params)
    kwargs = dict(params)
    if type_name.lower() in _ADAM_TYPES:
        torch_adam = kwargs.get("torch_adam", False)
        for key in _ADAM_EXTRA_KEYS:
            kwargs.pop(key, None)
        if not torch_adam:
            kwargs.setdefault("weight_decay", 0.0)  # [Note: Adam weight decay default]
    cls = _optimizer_class(type_name, params)
    return cls(param_groups, **kwargs)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, type_name: str, params: Mapping[str, Any]) -> LRScheduler:
    """Builds the LR scheduler a `scheduler` block names, stepping `optimizer`.

    The engine calls its `step()` once per optimizer step, as DeepSpeed's engine does.

    Args:
        optimizer: the optimizer whose learning rates the scheduler sets (its construction already sets them).
        type_name: the block's `type`: one of DeepSpeed's schedules (`lr_schedules`) or a
            `torch.optim.lr_scheduler` class.
        params: the block's `params`, with every "auto" already filled.

    Returns:
        The scheduler; it checkpoints through `state_dict()` / `load_state_dict()` like any torch scheduler.

    Raises:
        ValueError: the block has problems (all of them are listed), still holds "auto" values, or a per-group
            list does not have one entry per param group of `optimizer`.
    """
    params = params or {}
    _raise_if_invalid("scheduler", scheduler_block_errors(type_name, params), params)
    return _scheduler_class(type_name)(optimizer, **params)


def _torch_classes(module: Any, base: type) -> dict[str, str]:
    """Lower-cased name → name of the public subclasses of `base` in `module`."""
    return {
        name.lower(): name
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base and not name.startswith("_")
    }


def _optimizer_refusal(type_name: str) -> str | None:
    key = type_name.lower()
    # DeepSpeed maps "lion" to its own kernels; a torch that ships Lion can run the same algorithm.
    if key == "lion" and key in _torch_classes(torch.optim, Optimizer):
        return None
    return _DEEPSPEED_ONLY_OPTIMIZERS.get(key)


def _optimizer_class(type_name: str, params: Mapping[str, Any]) -> type[Optimizer] | None:
    key = type_name.lower()
    if key in _ADAM_TYPES:
        adam_w_mode = params.get("adam_w_mode", True)
        # DeepSpeed: "AdamW" is always decoupled; "Adam" is too unless adam_w_mode is explicitly false.
        return torch.optim.AdamW if key == "adamw" or adam_w_mode is not False else torch.optim.Adam
    name = _torch_classes(torch.optim, Optimizer).get(key)
    return None if name is None else getattr(torch.optim, name)


def _scheduler_class(type_name: str) -> type[LRScheduler] | None:
    key = type_name.lower()
    if key in _DEEPSPEED_SCHEDULERS:
        return _DEEPSPEED_SCHEDULERS[key]
    if key in _UNBUILDABLE_SCHEDULERS:
        return None
    name = _torch_classes(torch.optim.lr_scheduler, LRScheduler).get(key)
    return None if name is None else getattr(torch.optim.lr_scheduler, name)


def _unknown_type_message(block: str, type_name: str, known: list[str]) -> str:
    message = f"{block}.type {type_name!r} is not a known {block}"
    close = difflib.get_close_matches(type_name.lower(), [name.lower() for name in known], n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {next(name for name in known if name.lower() == close[0])!r}?"
    return message + f" Supported types: {', '.join(known)}."


def _raise_if_invalid(block: str, errors: list[str], params: Mapping[str, Any]) -> None:
    errors = errors + [
        f"{block}.params.{key} is still 'auto': resolve the config before building (or set a value)"
        for key, value in params.items()
        if _is_auto(value)
    ]
    if errors:
        raise ValueError(f"Invalid {block} block:\n- " + "\n- ".join(errors))


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _signature_errors(
    block: str,
    type_name: str,
    cls: type,
    params: Mapping[str, Any],
    translated: tuple[str, ...],
    value_check: Callable[[str, Any, Any], str | None] | None,
) -> list[str]:
    """Unknown keys, missing required keys and (via `value_check`) bad values, read off `cls.__init__`.

    `translated` keys are accepted without being parameters of `cls`: the caller checks and consumes them.
    """
    signature = inspect.signature(cls.__init__)
    accepted = {
        name: parameter
        for name, parameter in list(signature.parameters.items())[2:]  # drop self and params / optimizer
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }
    takes_any_key = any(parameter.kind is parameter.VAR_KEYWORD for parameter in signature.parameters.values())
    target = _describe(type_name, cls)
    errors = []
    for key in sorted(params):
        if key in translated:
            continue
        if key not in accepted:
            if not takes_any_key:
                errors.append(_unknown_key_message(block, target, key, sorted([*accepted, *translated])))
            continue
        if value_check is not None and not _is_auto(params[key]):
            error = value_check(key, params[key], accepted[key].default)
            errors += [f"{block}.params.{key} {error}"] if error else []
    for name, parameter in accepted.items():
        if parameter.default is parameter.empty and name not in params:
            errors.append(f"{block}.params is missing {name!r}, which {target} requires")
    return errors


def _describe(type_name: str, cls: type) -> str:
    """`type_name`, followed by the torch class it builds when it builds one."""
    for module_name, module in (("torch.optim", torch.optim), ("torch.optim.lr_scheduler", torch.optim.lr_scheduler)):
        if getattr(module, cls.__name__, None) is cls:
            return f"{type_name} ({module_name}.{cls.__name__})"
    return type_name


def _unknown_key_message(block: str, target: str, key: str, accepted: list[str]) -> str:
    message = f"{block}.params.{key} is not a parameter of {target}"
    close = difflib.get_close_matches(key, accepted, n=1)
    message += f"; did you mean {close[0]!r}?" if close else "."
    return message + f" Accepted: {', '.join(accepted)}."


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but `lr: true` is a mistake, not 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _got(value: Any) -> str:
    hint = ""
    if isinstance(value, str):
        try:
            float(value)
            hint = ": write the number without quotes"
        except ValueError:
            pass
    return f"got {value!r} ({type(value).__name__}){hint}"


def _optimizer_value_check(key: str, value: Any, default: Any) -> str | None:
    """Checks a value against the kind of its torch default: a bool, a number, or a tuple such as `betas`."""
    if key == "lr" or _is_number(default):
        return None if _is_number(value) else f"must be a number, {_got(value)}"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"must be true or false, {_got(value)}"
    if key == "betas" or isinstance(default, tuple):
        size = len(default) if isinstance(default, tuple) else 2
        entries_ok = isinstance(value, (list, tuple)) and len(value) == size
        if entries_ok and all(_is_number(v) or (v is None and d is None) for v, d in zip(value, default, strict=True)):
            return None
        return f"must be a list of {size} numbers, {_got(value)}"
    return None


def _adam_extra_key_errors(params: Mapping[str, Any]) -> list[str]:
    errors = []
    for key in ("adam_w_mode", "torch_adam"):
        if key in params and not _is_auto(params[key]) and not isinstance(params[key], bool):
            errors.append(f"optimizer.params.{key} must be true or false, {_got(params[key])}")
    if "bias_correction" in params and params["bias_correction"] is not True:
        errors.append(
            "optimizer.params.bias_correction can only be true: torch's Adam and AdamW always correct the bias; "
            "remove the key"
        )
    return errors


def _number_per_group(value: Any) -> bool:
    return _is_number(value) or (isinstance(value, (list, tuple)) and bool(value) and all(map(_is_number, value)))


_PER_GROUP = "must be a number or a list of numbers (one per param group)"
# Value rules of DeepSpeed's schedule parameters; a key means the same thing in every schedule that has it.
_SCHEDULE_VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "warmup_min_lr": (_number_per_group, _PER_GROUP),
    "warmup_max_lr": (lambda v: v is None or _number_per_group(v), f"{_PER_GROUP}, or null for the optimizer's lr"),
    "warmup_num_steps": (lambda v: _is_int(v) and v > 0, "must be a positive integer"),
    "warmup_type": (lambda v: v in lr_schedules.WARMUP_TYPES, f"must be one of {lr_schedules.WARMUP_TYPES}"),
    "total_num_steps": (lambda v: _is_int(v) and v >= 0, "must be a non-negative integer"),
    "warmup_min_ratio": (_is_number, "must be a number"),
    "cos_min_ratio": (_is_number, "must be a number"),
    "last_batch_iteration": (lambda v: _is_int(v) and v >= -1, "must be an integer >= -1"),
    "lr_range_test_min_lr": (_number_per_group, _PER_GROUP),
    "lr_range_test_step_size": (lambda v: _is_int(v) and v > 0, "must be a positive integer"),
    "lr_range_test_step_rate": (_is_number, "must be a number"),
    "lr_range_test_staircase": (lambda v: isinstance(v, bool), "must be true or false"),
    "cycle_min_lr": (_number_per_group, _PER_GROUP),
    "cycle_max_lr": (_number_per_group, _PER_GROUP),
    "decay_lr_rate": (_is_number, "must be a number"),
    "cycle_first_step_size": (lambda v: _is_number(v) and v > 0, "must be a positive number"),
    "cycle_second_step_size": (lambda v: v is None or (_is_number(v) and v >= 0), "must be a number >= 0 or null"),
    "cycle_first_stair_count": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "cycle_second_stair_count": (lambda v: v is None or (_is_int(v) and v >= 0), "must be an integer >= 0 or null"),
    "decay_step_size": (lambda v: _is_number(v) and v >= 0, "must be a number >= 0"),
    "cycle_momentum": (lambda v: isinstance(v, bool), "must be true or false"),
    "cycle_min_mom": (_number_per_group, _PER_GROUP),
    "cycle_max_mom": (_number_per_group, _PER_GROUP),
    "decay_mom_rate": (_is_number, "must be a number"),
}


def _schedule_value_check(key: str, value: Any, default: Any) -> str | None:
    rule = _SCHEDULE_VALUE_RULES.get(key)
    if rule is None or rule[0](value):
        return None
    return f"{rule[1]}, {_got(value)}"
