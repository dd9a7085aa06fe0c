"""What the engine logs every `steps_per_print` steps: progress, and with `wall_clock_breakdown` /
`memory_breakdown` the time per phase and the bytes held."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Protocol

import torch

from accelerate_zero.config import ZeroConfig


class ZeroEngine(Protocol):
    """What a progress line reads from the engine (engine.py implements it; typed here so that this module, which
    the engine imports, does not import the engine back)."""

    global_steps: int
    skipped_steps: int

    @property
    def loss_scale(self) -> float: ...

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> float | None: ...

    def memory_breakdown(self) -> dict[str, int]: ...


logger = logging.getLogger("accelerate_zero")


class StepLog:
    """Rank-0 logging driven by `steps_per_print`, `wall_clock_breakdown` and `memory_breakdown`.

    Progress lines appear every `steps_per_print` optimizer steps (never when it is unset). The breakdowns
    appear at the same interval, or after every step when `steps_per_print` is unset.
    """

    def __init__(self, config: ZeroConfig, rank: int, device: torch.device) -> None:
        self.device = device
        self.interval = config.steps_per_print
        self.wall_clock = bool(config.wall_clock_breakdown)
        self.memory = bool(config.memory_breakdown)
        self.rank = rank
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        if not self.wall_clock:
            yield
            return
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self.seconds[phase] += time.perf_counter() - start

    def after_step(self, engine: ZeroEngine) -> None:
        step = engine.global_steps
        due = self.interval is not None and self.interval > 0 and step % self.interval == 0
        if self.rank != 0:
            return
        if due:
            logger.info(
                "step=%d skipped=%d lr=%s loss_scale=%g grad_norm=%s",
                step,
                engine.skipped_steps,
                engine.get_lr(),
                engine.loss_scale,
                engine.get_global_grad_norm(),
            )
        if (due or not self.interval) and self.wall_clock:
            times = " ".join(f"{phase}={1000 * s:.1f}ms" for phase, s in sorted(self.seconds.items()))
            logger.info("step=%d time since last report: %s", step, times)
            self.seconds.clear()
        if (due or not self.interval) and self.memory:
            logger.info("step=%d memory held (bytes): %s", step, engine.memory_breakdown())


def _synchronize(device: torch.device) -> None:
    """Waits for the engine's device (not the current one: a script may have left another current)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
