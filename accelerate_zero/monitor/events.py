"""The events of one optimizer step, named as DeepSpeed 0.19.8's engine names them.

[Note: the monitor's events]
DeepSpeed's engine writes, on rank 0 after every optimizer step, `(name, value, global_samples)` events:
`Train/Samples/lr` (the first param group's learning rate) and, under fp16, `Train/Samples/loss_scale`; with
`wall_clock_breakdown`, `Train/Samples/elapsed_time_ms_forward`, `..._backward` and `..._step` (the step's
milliseconds). Its pipeline engine adds `Train/Samples/train_loss` (the step's loss averaged over the data-parallel
ranks). The step of every event is the number of samples trained so far (`global_samples`: optimizer steps x
train_batch_size). These are written here with the same names and steps, at the same cadence, plus
`Train/Samples/train_loss` (as the pipeline engine writes it: the mean of every micro-batch loss passed to backward
on every rank), `Train/Samples/grad_norm` (the global gradient norm before clipping, when the step computed it) and,
with `memory_breakdown`, `Train/Samples/memory_<kind>_bytes` (the bytes `engine.memory_breakdown()` counts).
DeepSpeed's `elapsed_time_ms_backward_inner` / `_backward_allreduce` split backward by its own hooks; here the
reduction overlaps backward, so only the whole backward is timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


Event = tuple[str, float, int]
"""(name, value, step), the tuple DeepSpeed's `Monitor.write_events` takes."""

PREFIX = "Train/Samples/"


@dataclass(frozen=True, kw_only=True)
class StepValues:
    """What the engine knows after an optimizer step."""

    samples: int
    """Samples trained so far (DeepSpeed's `global_samples`): the event's step."""
    lr: float
    """The first param group's learning rate."""
    train_loss: float | None = None
    """The mean of the step's micro-batch losses over every rank; None when nothing was recorded."""
    loss_scale: float | None = None
    """The fp16 loss scale; None without fp16 (DeepSpeed writes it under fp16 only)."""
    grad_norm: float | None = None
    """The global gradient norm before clipping; None when the step did not compute it."""
    elapsed_ms: dict[str, float] = field(default_factory=dict)
    """Milliseconds of the step per phase ("forward", "backward", "step"), with `wall_clock_breakdown`."""
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes held per kind, with `memory_breakdown`."""


def step_events(values: StepValues) -> list[Event]:
    """The step's events ([Note: the monitor's events])."""
    step = values.samples
    events: list[Event] = []
    if values.train_loss is not None:
        events.append((f"{PREFIX}train_loss", values.train_loss, step))
    events.append((f"{PREFIX}lr", values.lr, step))
    if values.loss_scale is not None:
        events.append((f"{PREFIX}loss_scale", values.loss_scale, step))
    if values.grad_norm is not None:
        events.append((f"{PREFIX}grad_norm", values.grad_norm, step))
    for phase in ("forward", "backward", "step"):
        if phase in values.elapsed_ms:
            events.append((f"{PREFIX}elapsed_time_ms_{phase}", values.elapsed_ms[phase], step))
    events += [(f"{PREFIX}memory_{kind}_bytes", float(count), step) for kind, count in values.memory_bytes.items()]
    return events
