"""What the engine logs every `steps_per_print` steps: progress, and with `wall_clock_breakdown` /
`memory_breakdown` the time per phase and the bytes held; and, after every optimizer step, the events of the
monitors the config turns on (accelerate_zero/monitor: [Note: the monitor's events] in monitor/events.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine import collectives
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.monitor import StepValues, build_monitors, step_events
from accelerate_zero.monitor.comms import CommsLog
from accelerate_zero.monitor.flops import FlopsProfile
from accelerate_zero.monitor.writers import any_enabled


class ZeroEngine(Protocol):
    """What a progress line reads from the engine (engine.py implements it; typed here so that this module, which
    the engine imports, does not import the engine back)."""

    global_steps: int
    skipped_steps: int
    config: ZeroConfig
    layout: Any
    comm_stats_counter: collectives.CommStats

    @property
    def loss_scale(self) -> float: ...

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> float | None: ...

    def memory_breakdown(self) -> dict[str, int]: ...


logger = logging.getLogger("accelerate_zero")


class StepLog:
    """Rank-0 logging driven by `steps_per_print`, `wall_clock_breakdown`, `memory_breakdown` and `comms_logger`.

    Progress lines appear every `steps_per_print` optimizer steps (never when it is unset). The breakdowns
    appear at the same interval, or after every step when `steps_per_print` is unset; the collectives' summary
    (DeepSpeed prints it when the script calls `deepspeed.comm.log_summary()`: here `engine.step_log.comms_log`) at
    that interval only.
    """

    def __init__(
        self, config: ZeroConfig, world: DataParallelGroup, device: torch.device, stats: collectives.CommStats
    ) -> None:
        """`world`: every rank of the run; `stats`: the engine's collective counters (`comms_logger` times them)."""
        self.device = device
        self.interval = config.steps_per_print
        self.wall_clock = bool(config.wall_clock_breakdown)
        self.memory = bool(config.memory_breakdown)
        self.rank = rank = world.rank
        self.comms_log = CommsLog(config.comms_logger, rank, world.world_size) if config.comms_logger.enabled else None
        """The `comms_logger` records ([Note: timing collectives] in engine/collectives.py); None when it is off."""
        stats.log = self.comms_log
        self.seconds: dict[str, float] = defaultdict(float)
        self.step_seconds: dict[str, float] = defaultdict(float)
        """The current optimizer step's seconds per phase, for the monitors."""
        self.monitors = build_monitors(config, rank)
        self.records_loss = any_enabled(config)
        """Every rank records its losses when a monitor is on: rank 0 writes their mean over the ranks."""
        self._losses: list[torch.Tensor] = []
        block = config.flops_profiler
        self.flops = FlopsProfile(block, rank, world.world_size) if block.enabled else None
        """The `flops_profiler` ([Note: the flops profile] in monitor/flops.py); None when it is off."""
        self.output_file = block.output_file
        self.completed_steps = 0
        self.samples_per_step = (config.train_micro_batch_size_per_gpu or 0) * config.gradient_accumulation_steps

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        profiling = self.flops is not None and self.flops.profiles(self.completed_steps)
        if not (self.wall_clock or profiling):
            yield
            return
        _synchronize(self.device)
        start = time.perf_counter()
        counting = self.flops.counting(phase) if profiling and phase != "step" else contextlib.nullcontext()
        try:
            with counting:
                yield
        finally:
            _synchronize(self.device)
            elapsed = time.perf_counter() - start
            if self.wall_clock:
                self.seconds[phase] += elapsed
                self.step_seconds[phase] += elapsed
            if profiling:
                self.flops.add_time(phase, elapsed)

    def record_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss as passed to backward (kept on its device until the step: no synchronization)."""
        if self.records_loss:
            self._losses.append(loss.detach().float().mean())

    def after_step(self, engine: ZeroEngine) -> None:
        if self.records_loss:
            self._write_monitors(engine)
        if self.flops is not None and self.flops.profiles(self.completed_steps):
            self._report_flops()
        self.completed_steps = engine.global_steps
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
        if due and self.comms_log is not None:
            logger.info("step=%d collectives since the start:\n%s", step, self.comms_log.summary())

    def _write_monitors(self, engine: ZeroEngine) -> None:
        """The step's events ([Note: the monitor's events]); every rank takes part in the loss's all-reduce."""
        losses, self._losses = self._losses, []
        # [sum, count] of the losses, summed over the ranks (every rank takes part, with or without losses)
        summed = torch.stack(losses).sum().to(self.device) if losses else torch.zeros((), device=self.device)
        total = torch.stack([summed, torch.tensor(float(len(losses)), device=self.device)])
        collectives.all_reduce(total, engine.layout.world, engine.comm_stats_counter, kind="all_reduce_monitor_loss")
        seconds, self.step_seconds = self.step_seconds, defaultdict(float)
        if self.monitors is None:
            return
        batch = engine.config.train_batch_size
        values = StepValues(
            samples=engine.global_steps * (batch if batch else 1),
            lr=engine.get_lr()[0],
            train_loss=float(total[0] / total[1]) if total[1] > 0 else None,
            loss_scale=engine.loss_scale if engine.config.fp16.enabled else None,
            grad_norm=engine.get_global_grad_norm(),
            elapsed_ms={phase: 1000 * s for phase, s in seconds.items()} if self.wall_clock else {},
            memory_bytes=engine.memory_breakdown() if self.memory else {},
        )
        self.monitors.write_events(step_events(values))

    def _report_flops(self) -> None:
        assert self.flops is not None
        summary = self.flops.report(self.completed_steps, self.samples_per_step)
        if self.output_file:
            with open(self.output_file, "a") as file:
                file.write(summary + "\n")
        else:
            logger.info("%s", summary)  # with the progress lines (DeepSpeed prints it to stdout)


def _synchronize(device: torch.device) -> None:
    """Waits for the engine's device (not the current one: a script may have left another current)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
