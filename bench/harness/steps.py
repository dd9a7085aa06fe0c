"""The timed loop on every rank, and the rank function that trains one peer on the Linear stack and measures it.

`train` is what `launch.on_ranks(W, steps.train, system="az3", steps=20)` runs: the baseline reading after the
imports and the process group, the model, the peer, `warmup` untimed then `steps` timed steps ([Note: how the
benchmark measures] in harness/readings.py), and one `Measurement` per rank.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import launch, models, peers, summary
from .readings import live_tensor_bytes, proc_status, reset_peak_rss, wire_bytes


@dataclass
class Measurement:
    """What one rank measured; harness/summary.py combines the ranks."""

    rank: int
    world_size: int
    params: int
    baseline: dict[str, int]
    after_warmup: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    peak_reset: bool = False
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)
    step_minor_faults: list[int] = field(default_factory=list)
    wire_bytes_per_step: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    live_tensor_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def start_measurement() -> Measurement:
    """Takes the baseline: call after the imports and the process group, before the model exists."""
    gc.collect()
    dist.barrier()
    baseline = proc_status()
    peak_reset = reset_peak_rss()
    return Measurement(dist.get_rank(), dist.get_world_size(), 0, baseline, peak_reset=peak_reset)


def run_steps(
    measurement: Measurement,
    step: Callable[[], torch.Tensor],
    *,
    warmup: int,
    steps: int,
    reset_comm: Callable[[], None],
) -> None:
    """Runs `warmup` untimed then `steps` timed steps; `reset_comm` is called between the two phases."""
    for _ in range(warmup):
        measurement.losses.append(float(step()))
    gc.collect()
    measurement.after_warmup = proc_status()
    dist.barrier()
    reset_comm()
    for _ in range(steps):
        dist.barrier()
        faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        wire_start, cpu_start, start = wire_bytes(), time.process_time(), time.perf_counter()
        loss = step()
        measurement.step_seconds.append(time.perf_counter() - start)
        measurement.step_cpu_seconds.append(time.process_time() - cpu_start)
        measurement.step_minor_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start)
        measurement.wire_bytes_per_step.append(wire_bytes() - wire_start)
        measurement.losses.append(float(loss))
    gc.collect()
    dist.barrier()
    measurement.after = proc_status()
    measurement.live_tensor_bytes = live_tensor_bytes()


@dataclass
class MicroProbe:
    """Readings right after every micro-step's backward, while the accumulated gradients are alive.

    The peak *during* the micro-steps is VmHWM at the end of the run; these are the readings *between* them: VmRSS
    after each backward (before the optimizer step on the boundary), and for the engine
    `memory_breakdown()["gradients"]` and how many stage-3 units are still gathered (`engine`: ours only). How each
    peer accumulates: harness/peers.py.
    """

    baseline_rss: int
    engine: Any = None
    rss_between: list[int] = field(default_factory=list)
    rss_after_boundary_backward: list[int] = field(default_factory=list)
    engine_grad_bytes_between: list[int] = field(default_factory=list)
    gathered_units_between: list[int] = field(default_factory=list)

    def after_backward(self, boundary: bool) -> None:
        rss = proc_status()["VmRSS"] - self.baseline_rss
        if boundary:
            self.rss_after_boundary_backward.append(rss)
            return
        self.rss_between.append(rss)
        if self.engine is not None:
            self.engine_grad_bytes_between.append(self.engine.memory_breakdown()["gradients"])
            units = getattr(self.engine, "units", None) or []
            self.gathered_units_between.append(sum(u.state.name != "SHARDED" for u in units))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_rss_between": max(self.rss_between, default=None),
            "max_rss_after_boundary_backward": max(self.rss_after_boundary_backward, default=None),
            "max_engine_grad_bytes_between": max(self.engine_grad_bytes_between, default=None),
            "max_gathered_units_between": max(self.gathered_units_between, default=None),
        }
        engine = self.engine
        if engine is not None:
            scheduler = getattr(engine, "scheduler", None)
            out["scheduler_peak_live_numel"] = getattr(scheduler, "peak_live_numel", None)
            out["reducer_peak_transient_bytes"] = getattr(engine.reducer, "peak_transient_bytes", None)
            units = getattr(engine, "units", None) or []
            out["largest_unit_numel"] = max((u.numel for u in units), default=None)
        return out


def train(
    system: str, *, steps: int, warmup: int, grad_accum: int = 1, reduce_bucket_size: int | None = None
) -> dict[str, Any]:
    """Rank function: peer `system` trains the Linear stack (harness/models.py) and is measured.

    Every peer's libraries are imported before the baseline, so RSS above it is training state, not modules.
    Returns this rank's `Measurement` as a dict, with `extra["micro"]` (the `MicroProbe`) and, for our engine,
    `extra["memory_breakdown"]`.
    """
    peers.preload(system)
    measurement = start_measurement()
    model = models.build_model()
    measurement.params = sum(p.numel() for p in model.parameters())
    x, y = models.make_batch(dist.get_rank())
    probe = MicroProbe(baseline_rss=measurement.baseline["VmRSS"])
    wrapped = peers.build(
        system,
        model,
        lambda module: nn.functional.mse_loss(module(x), y),
        lr=models.LR,
        grad_accum=grad_accum,
        zero_config=models.engine_config(int(system[-1]), reduce_bucket_size) if system[-1].isdigit() else None,
        after_backward=probe.after_backward,
    )
    probe.engine = wrapped.engine if system.startswith("az") else None
    run_steps(measurement, wrapped.step, warmup=warmup, steps=steps, reset_comm=wrapped.reset_comm)
    measurement.comm = wrapped.comm()
    measurement.extra.update(grad_accum=grad_accum, micro=probe.as_dict())
    if system.startswith("az"):
        measurement.extra["memory_breakdown"] = wrapped.engine.memory_breakdown()
    if system.startswith("ds"):
        import deepspeed

        measurement.extra["deepspeed_version"] = deepspeed.__version__
    return asdict(measurement)


def runnable(systems: list[str], ds_venv: Path) -> list[str]:
    """`systems` without DeepSpeed's when its virtualenv does not exist (says so): they are skipped, not failed."""
    if launch.deepspeed_python(ds_venv) is not None:
        return list(systems)
    skipped = [system for system in systems if system.startswith("ds")]
    if skipped:
        print(f"no DeepSpeed virtualenv at {ds_venv}: skipping {', '.join(skipped)}")
    return [system for system in systems if not system.startswith("ds")]


def launch_train(
    system: str,
    world_size: int,
    *,
    out_dir: Path,
    ds_venv: Path = launch.DEFAULT_DS_VENV,
    round_index: int = 0,
    function: Callable[..., dict[str, Any]] | None = None,
    **train_kwargs: Any,
) -> list[dict[str, Any]] | None:
    """Driver side: `train` (or `function`, a rank function that calls it) for `system` on `world_size` fresh ranks
    (DeepSpeed from `ds_venv`).

    Returns every rank's record (`summary.records`), or None when the group failed (its log's end is printed).
    DeepSpeed's virtualenv must exist (`runnable` leaves its systems out otherwise).
    """
    name = system if round_index == 0 else f"{system}.round{round_index + 1}"
    python = launch.deepspeed_python(ds_venv) if system.startswith("ds") else None
    try:
        ranks = launch.on_ranks(
            world_size,
            function or train,
            {"system": system, **train_kwargs},
            name=name,
            out_dir=out_dir,
            python=python,
        )
    except launch.LaunchFailed as failed:
        print(f"  FAILED {failed}")
        return None
    return summary.records(ranks)
