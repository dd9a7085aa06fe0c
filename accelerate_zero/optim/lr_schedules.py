"""DeepSpeed's config-named LR schedules, rewritten as `torch.optim.lr_scheduler.LRScheduler` subclasses.

A DeepSpeed config names `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` or `LRRangeTest` in its
`scheduler` block. These classes take the same parameter names and defaults as DeepSpeed 0.19 and produce the same
learning rates at every step, but they checkpoint and resume like any torch scheduler (`state_dict` /
`load_state_dict`) and need no DeepSpeed install. All five are closed-form: the lr depends only on the step count.

[Note: step counting]
DeepSpeed's schedulers count `last_batch_iteration`: it is -1 after construction and each `step()` adds one. A torch
scheduler counts `last_epoch`, which its own constructor already steps from -1 to 0. So here
`last_batch_iteration == last_epoch - 1` always, and every formula below is written in DeepSpeed's
`last_batch_iteration` (named `iteration`). The consequence users see: after construction the optimizer holds the
lr of iteration -1 (the warmup start), the first `step()` moves to iteration 0 (for a warmup still the start value,
since log(1) = 0 and 0 / n = 0), and the n-th optimizer step runs with the lr of iteration n - 2. That is exactly what
DeepSpeed's engine produces, since it too steps the scheduler once after each optimizer step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")
"""The warmup curves DeepSpeed's warmup schedules know."""


def _per_group(value: Any, optimizer: Optimizer, name: str) -> list[Any]:
    """Broadcasts a scalar to one value per param group, or checks a per-group list has one entry per group."""
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {num_groups} param groups: "
                f"give one value, or one per param group"
            )
        return list(value)
    return [value] * num_groups


def _group_lrs(optimizer: Optimizer) -> list[Any]:
    """Each group's lr before any scheduler touched it (torch records it as `initial_lr`), else its current lr."""
    return [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> None:
    # bool is an int subclass, but `warmup_num_steps: true` is a config mistake, not 1.
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    # DeepSpeed logs a warning and falls back to "log" here; a typo silently changing the curve is worse than an error.
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup is at `iteration` (0 → 1), for an iteration inside the warmup window."""
    if warmup_type == "log":
        # Reaches exactly 1 at iteration warmup_num_steps - 1; the clamp to >= 2 steps keeps log(n) non-zero.
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _ClosedFormLR(LRScheduler):
    """Base for schedules whose lr is a function of DeepSpeed's iteration count (see [Note: step counting])."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        if last_batch_iteration != -1:
            # DeepSpeed resumes from any iteration without torch's `initial_lr` bookkeeping; supply it.
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        # torch's constructor steps once, turning last_epoch into last_batch_iteration + 1.
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step counter: -1 right after construction, +1 per `step()`."""
        return self.last_epoch - 1

    def get_lr(self) -> list[Any]:
        """Returns each param group's lr at the current step."""
        return self._lrs_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[Any]:
        # torch uses this for the (deprecated) `step(epoch)`; our schedules are closed-form anyway.
        return self._lrs_at(self.last_epoch - 1)

    def _lrs_at(self, iteration: int) -> list[Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state from `state_dict()`, or DeepSpeed's own `{"last_batch_iteration": n}` scheduler state.

        Args:
            state_dict: the dict `state_dict()` returned, or a DeepSpeed scheduler's state dict (so a DeepSpeed
                checkpoint's schedule position carries over).
        """
        if "last_epoch" not in state_dict and "last_batch_iteration" in state_dict:
            self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
            return
        super().load_state_dict(state_dict)


class WarmupLR(_ClosedFormLR):
    """Warms the lr up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps` steps, then holds it.

    lr(i) = min + (max - min) * g(i), where i is DeepSpeed's iteration count (see [Note: step counting]) and
    g(i) = log(i + 1) / log(n) ("log") or i / n ("linear") while i < n = max(2, warmup_num_steps), then 1.

    Args:
        optimizer: the optimizer whose param groups' lrs this sets.
        warmup_min_lr: lr at the start of warmup; a scalar, or one value per param group. Default 0.0.
        warmup_max_lr: lr at the end of warmup; a scalar or one value per param group. None (the default) means
            each group's own lr, as in DeepSpeed 0.19 (0.16 defaulted to 0.001).
        warmup_num_steps: warmup length in steps; a positive integer, raised to 2 if it is 1 (as DeepSpeed does).
            Default 1000.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: DeepSpeed's resume position; -1 (default) starts the schedule.

    Raises:
        ValueError: `warmup_num_steps` is not a positive integer, `warmup_type` is unknown, or a per-group list
            has the wrong length.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = _group_lrs(optimizer)
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[Any]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`'s warmup, then a linear decay that reaches `warmup_min_lr` at step `total_num_steps`.

    After warmup, g(i) = max(0, (total_num_steps - i) / max(1, total_num_steps - n)) in `WarmupLR`'s formula.

    Args:
        optimizer: the optimizer whose param groups' lrs this sets.
        total_num_steps: step at which the decay ends.
        warmup_min_lr: as in `WarmupLR`. Default 0.0.
        warmup_max_lr: as in `WarmupLR`, but the default is 0.001, as in DeepSpeed 0.19 (which changed the
            default to "the optimizer's lr" for `WarmupLR` only). None means each group's own lr.
        warmup_num_steps: as in `WarmupLR`. Default 1000.
        warmup_type: as in `WarmupLR`. Default "log".
        last_batch_iteration: as in `WarmupLR`. Default -1.

    Raises:
        ValueError: as `WarmupLR`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"WarmupDecayLR: {total_num_steps=} is less than warmup_num_steps={self.warmup_num_steps}")

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_ClosedFormLR):
    """Scales each group's own lr: warmup from `warmup_min_ratio` to 1, then a cosine decay to `cos_min_ratio`.

    lr(i) = group_lr * r(i), where during warmup (i < n = max(2, warmup_num_steps))
    r(i) = warmup_min_ratio + (1 - warmup_min_ratio) * g(i) with `WarmupLR`'s g, and afterwards, with
    p = min(1, (i - n + 1) / max(1, total_num_steps - n)),
    r(i) = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2). Before the first `step()` the lr is 0.

    Args:
        optimizer: the optimizer whose param groups' lrs this scales; each group's lr at construction is its peak.
        total_num_steps: step at which the cosine reaches `cos_min_ratio` (it then stays there).
        warmup_min_ratio: lr ratio at the start of warmup. Default 0.0.
        warmup_num_steps: warmup length in steps; as in `WarmupLR`. Default 1000.
        cos_min_ratio: lr ratio at the end of the cosine. Default 0.0001.
        warmup_type: "log" (default) or "linear".
        last_batch_iteration: DeepSpeed's resume position; -1 (default) starts the schedule.

    Raises:
        ValueError: as `WarmupLR`.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.peak_lrs = _group_lrs(optimizer)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"WarmupCosineLR: {total_num_steps=} is less than warmup_num_steps={self.warmup_num_steps}")
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, iteration: int) -> float:
        """Returns the factor applied to each group's peak lr at DeepSpeed iteration `iteration`."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so that stepping past total_num_steps holds the floor instead of climbing the cosine back up.
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[Any]:
        ratio = self.lr_ratio(iteration)
        return [peak * ratio for peak in self.peak_lrs]


class LRRangeTest(_ClosedFormLR):
    """Learning-rate range test: grows the lr from `lr_range_test_min_lr` without bound, to find where training diverges.

    lr(i) = min_lr * (1 + step_rate * k), with k = (i + 1) / step_size, or floor((i + 1) / step_size) when
    `lr_range_test_staircase` is true.

    Args:
        optimizer: the optimizer whose param groups' lrs this sets.
        lr_range_test_min_lr: starting lr; a scalar or one value per param group. Default 0.001.
        lr_range_test_step_size: steps per unit of growth; a positive integer. Default 2000.
        lr_range_test_step_rate: growth per `lr_range_test_step_size` steps, as a multiple of the start. Default 1.0.
        lr_range_test_staircase: grow in whole stairs rather than continuously. Default False.
        last_batch_iteration: DeepSpeed's resume position; -1 (default) starts the schedule.

    Raises:
        ValueError: `lr_range_test_step_size` is not a positive integer, or a per-group list has the wrong length.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        step_size = lr_range_test_step_size
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {step_size!r}")
        self.min_lrs = _per_group(lr_range_test_min_lr, optimizer, "lr_range_test_min_lr")
        self.step_size = step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def _lrs_at(self, iteration: int) -> list[Any]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1.0 + self.step_rate * interval) for low in self.min_lrs]


class OneCycle(_ClosedFormLR):
    """The 1cycle policy: one triangular lr cycle between `cycle_min_lr` and `cycle_max_lr`, then an optional decay.

    With u = i + 1 (i is DeepSpeed's iteration count, see [Note: step counting]) the cycle's scale is u / first on the
    way up (u <= first) and (first + second - u) / second on the way down, quantised to `floor(scale * stairs) /
    stairs` when that half has a stair count; lr = min + (max - min) * scale. After the cycle (u > first + second),
    lr = min / (1 + decay_lr_rate * d / decay_step_size) with d = u - first - second, or `cycle_min_lr` when either
    decay knob is 0. When momentum cycles, beta1 moves the opposite way between `cycle_max_mom` and `cycle_min_mom`,
    and after the cycle it is max_mom * (1 + decay_mom_rate * d / decay_step_size).

    Matches DeepSpeed 0.19's `OneCycle`, quirks included: momentum cycles only for optimizers with `betas` (Adam-like;
    SGD's `momentum` is left alone, with a warning), each group's `betas` becomes `(beta1, 0.99)` (beta2 is
    overwritten with 0.99), and beta1 is `cycle_min_mom` until the first `step()`.

    Args:
        optimizer: the optimizer whose param groups' lrs (and betas) this sets.
        cycle_min_lr: lr at the start and end of the cycle; a scalar or one value per param group.
        cycle_max_lr: lr at the top of the cycle; a scalar or one value per param group.
        decay_lr_rate: post-cycle lr decay rate. Default 0 (no decay).
        cycle_first_step_size: steps in the rising half; must be positive. Default 2000.
        cycle_second_step_size: steps in the falling half; None (default) means `cycle_first_step_size`.
        cycle_first_stair_count: stairs in the rising half; 0 (default) means continuous.
        cycle_second_stair_count: stairs in the falling half; None (default) means `cycle_first_stair_count`.
        decay_step_size: steps per unit of post-cycle decay; 0 (default) means no decay.
        cycle_momentum: cycle beta1 inversely to the lr. Default True.
        cycle_min_mom: lowest beta1; a scalar or one value per param group. Default 0.8.
        cycle_max_mom: highest beta1; a scalar or one value per param group. Default 0.9.
        decay_mom_rate: post-cycle beta1 growth rate. Default 0.
        last_batch_iteration: DeepSpeed's resume position; -1 (default) starts the schedule.

    Raises:
        ValueError: a step size is out of range, or a per-group list has the wrong length.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self._init_cycle(
            cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count
        )
        self.min_lrs = _per_group(cycle_min_lr, optimizer, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, optimizer, "cycle_max_lr")
        self.min_moms = _per_group(cycle_min_mom, optimizer, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, optimizer, "cycle_max_mom")
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning(f"OneCycle: momentum is not cycled: {type(optimizer).__name__} has no `betas`")
        super().__init__(optimizer, last_batch_iteration)

    def _init_cycle(self, first: int, second: int | None, first_stairs: int, second_stairs: int | None) -> None:
        self.first_step_size = float(first)
        self.second_step_size = self.first_step_size if second is None else float(second)
        # A zero-length rising half would divide by zero in the scale.
        if self.first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first!r}")
        if self.second_step_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second!r}")
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = first_stairs
        self.second_stair_count = first_stairs if second_stairs is None else second_stairs

    def _scale(self, iteration: int) -> float:
        """Position in the cycle: 0 at its ends, 1 at its peak."""
        position = (iteration + 1) % self.total_size
        rising = position <= self.first_step_size
        steps_from_bottom = position if rising else self.total_size - position
        half_size = self.first_step_size if rising else self.second_step_size
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:
            # Multiply before dividing: (steps / size) * stairs can land 1e-16 under a whole stair and floor a step low.
            return math.floor(steps_from_bottom * stairs / half_size) / stairs
        return steps_from_bottom / half_size

    def _decay_factor(self, iteration: int, rate: float) -> float:
        return 1.0 + rate * ((iteration + 1 - self.total_size) / self.decay_step_size)

    def _lrs_at(self, iteration: int) -> list[Any]:
        if iteration + 1 <= self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = self._decay_factor(iteration, self.decay_lr_rate)
        return [low / factor for low in self.min_lrs]

    def momentums_at(self, iteration: int) -> list[float]:
        """Returns each param group's beta1 at DeepSpeed iteration `iteration`."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration + 1 <= self.total_size:
            scale = self._scale(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = self._decay_factor(iteration, self.decay_mom_rate)
        return [high * factor for high in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        """Moves to the next step's lr and, when momentum cycles, the next step's betas.

        Args:
            epoch: deprecated by torch; leave it None.
        """
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.momentums_at(self.last_epoch - 1), strict=True):
                group["betas"] = (beta1, 0.99)
