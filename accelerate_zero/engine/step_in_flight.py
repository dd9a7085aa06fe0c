"""StepInFlight: the offloaded host step running on a worker thread while the next forward runs, each stage-3
unit waiting only for the slices of its own shard.

[Note: the host step across the step boundary]
With `offload_optimizer` the optimizer step is host work (AdamW over fp32 masters in host memory, then an upload of
each chunk into the parameter shards): done before `engine.step()` returns, it leaves the device idle for all of it.
Everything that decides the update is known before the host work starts: the global gradient norm, the overflow
flag and the clipping coefficient are computed on the calling thread, and the loss scale updated there. So the
slices are then stepped on a worker thread, chunk by chunk in the order of the parameters (the runner's own order,
[Note: the pipelined host step] in offload/pipelined_step.py), and `engine.step()` returns at once. Each slice goes
pending -> stepping -> uploaded (transitions asserted); then, once everything waited for it, settled.

Who waits for what, so that every read sees exactly what the synchronous schedule would have shown:
- a stage-3 shard is read through its store (a gather of the next forward, a prefetch, `GatheredParameters`,
  `full_state_dict`): `ShardsInMemory` calls `wait_for(shard)` first, which returns once every slice whose parameters
  overlap that shard is uploaded (on a GPU the reading stream also waits for the upload's event);
- masters and optimizer state (`resident_slices`: checkpoint save and load, `refresh_masters`, `held_tensors`: memory
  accounting and `offload_states`) and the gradients the step reads (the next backward, `zero_grad`, the next step,
  `destroy`): `settle()` waits for the whole step, then runs what the synchronous step ran after it (zeroing the
  gradients), on the calling thread.
The worker steps a private view of the user's optimizer: the same state and hooks, its param groups copied when the
step starts, so an LR scheduler stepping right after `engine.step()` changes the next step's learning rate, not this
one's, as in the synchronous schedule. The arithmetic is the synchronous schedule's, element by element (the same
chunks, coefficient, gradients and state), so the result is bit-identical; only its timing moves.
Only stage 3 with shards in memory gates its reads this way (stages 1 and 2 read parameters directly, and a shard in
a file has reads of its own in flight): elsewhere the step stays synchronous. At stage 3 the slices whose parameters
are not in a unit's shard (persistent parameters, read directly) are stepped before `engine.step()` returns, and
published; only the units' slices go to the worker. While it runs, the scheduler gathers the next forward's first
units ahead (engine/stage3/schedule.py `prefetch_ahead`), each once its slices are uploaded.
It is on by default beside a GPU; on a CPU device the host step would take its cores from the forward (on a shared
2-core machine it was slower: bench/README.md), so there it is off unless `ACCELERATE_ZERO_OVERLAP_STEP=1` (the tests
run the GPU's schedule on the CPU this way); `ACCELERATE_ZERO_OVERLAP_STEP=0` turns it off everywhere.
What it does not yet overlap: the next backward waits for the whole host step (it rewrites the gradients the step
reads), so with gradient accumulation only the first micro-step's forward hides it; stages 1 and 2; parameters in
files (`offload_param: nvme`).
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import torch
from torch.profiler import record_function

from accelerate_zero.engine.host_copies import HostCopies


if TYPE_CHECKING:
    from accelerate_zero.engine.shard_slice import ShardSlice
    from accelerate_zero.engine.stores import StepRunner


OVERLAP_ENV = "ACCELERATE_ZERO_OVERLAP_STEP"


def overlap_enabled(device: torch.device) -> bool:
    """Whether the offloaded host step runs across the step boundary: `ACCELERATE_ZERO_OVERLAP_STEP` 1 or 0; unset,
    beside a GPU only (on a CPU device the host step and the forward would share the same cores)."""
    raw = os.environ.get(OVERLAP_ENV)
    if raw is None:
        return device.type != "cpu"
    if raw not in ("0", "1"):
        raise ValueError(
            f"{OVERLAP_ENV}={raw!r}: set it to 1 (overlap the host step), 0 (step synchronously) or unset it "
            "(overlap beside a GPU)"
        )
    return raw == "1"


class SliceState(enum.Enum):
    SETTLED = "settled"
    PENDING = "pending"
    STEPPING = "stepping"
    UPLOADED = "uploaded"


def private_view(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer with the same state and hooks and its own copy of the param groups (hyperparameters as they are
    now). An LR scheduler replaces the instance's `step` with a wrapper bound to the original: the view drops it and
    steps with its class's `step` (the scheduler's "step before optimizer.step()" check is told the step ran)."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.__dict__.pop("step", None)
    view.param_groups = [dict(group) for group in optimizer.param_groups]
    if "step" in vars(optimizer):
        optimizer._opt_called = True  # what the scheduler's wrapper records when the original is stepped
    return view


class _WorkerStepper:
    """The `SliceStepper` the worker hands the runner: steps a batch with the private optimizer view and the worker's
    own copies, marking its slices as it goes."""

    def __init__(self, sharded: OffloadedStepper, flight: StepInFlight, optimizer: torch.optim.Optimizer) -> None:
        self.sharded, self.flight, self.optimizer = sharded, flight, optimizer

    def step_slices(
        self, slices: list[ShardSlice], coefficient: float, grads: list[torch.Tensor] | None = None
    ) -> None:
        self.flight._move(slices, SliceState.PENDING, SliceState.STEPPING)
        self.sharded.step_slices(slices, coefficient, grads, optimizer=self.optimizer, copies=self.flight.copies)
        self.flight._uploaded(slices)


class OffloadedStepper(Protocol):
    """What the worker drives (engine/sharded_optimizer.py's `ShardedOptimizer`)."""

    optimizer: torch.optim.Optimizer

    def step_slices(
        self,
        slices: list[ShardSlice],
        coefficient: float,
        grads: list[torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        copies: HostCopies | None = None,
    ) -> None: ...


class StepInFlight:
    """One rank's host step on a worker thread (see the note above)."""

    def __init__(
        self,
        runner: StepRunner,
        slices: list[ShardSlice],
        device: torch.device,
        threads: AbstractContextManager | None,
        profile_range: str,
    ) -> None:
        """`threads`: entered by the worker (offload/host_threads.py); `profile_range`: the profiler range its step
        runs in (the host step lane of bench/gpu_compare_worker.py)."""
        self.runner, self.slices, self.device, self.profile_range = runner, slices, device, profile_range
        self.threads = threads if threads is not None else nullcontext()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies = HostCopies(device)
        """The worker's own uploads (HostCopies is not shared across threads)."""
        self.states = {id(s): SliceState.SETTLED for s in slices}
        self._ranges: list[tuple[tuple[str, int, int], ShardSlice]] = []
        self._worker: set[int] = set()
        """ids of the slices the worker steps (`plan`)."""
        self._events: dict[int, torch.cuda.Event] = {}
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._then: list[Callable[[], None]] = []
        self.launches = 0
        """Steps run across the boundary (tests and benchmarks read it)."""
        self.waits = 0
        """Reads that found their slices not yet uploaded and waited (tests and benchmarks read it)."""

    @property
    def running(self) -> bool:
        return self._thread is not None

    def plan(self, gated: list[torch.Tensor]) -> bool:
        """Picks the slices the worker steps: those whose parameters lie in a `gated` shard (read only through the
        store's gate); the others are stepped by `step_direct`. False: nothing to overlap, or the runner cannot step
        a part of the slices (step synchronously then). Addresses are taken now: sleeping moves storages."""
        assert self._thread is None, "StepInFlight.plan() while a step is in flight: settle() it first"
        spans = [_span(t) for t in gated if t.numel()]
        self._ranges = [(_span(s.params), s) for s in self.slices if s.params.numel()]
        self._worker = {
            id(s) for (d, a, b), s in self._ranges if any(d == e and a < hi and lo < b for e, lo, hi in spans)
        }
        splits = len(self._worker) == len(self.slices) or hasattr(self.runner, "step_where")
        return bool(self._worker) and splits

    def step_direct(self, sharded: OffloadedStepper, coefficient: float) -> None:
        """Steps, on this thread, the slices the worker does not (parameters read directly: stage 3's persistent
        ones), so that they can be published before `launch`."""
        if len(self._worker) < len(self.slices):
            self.runner.step_where(sharded, coefficient, lambda s: id(s) not in self._worker)

    def launch(self, sharded: OffloadedStepper, coefficient: float, then: list[Callable[[], None]]) -> None:
        """Starts stepping the slices `plan` gave the worker; `then` runs on the thread that settles the step."""
        assert self._thread is None, "StepInFlight.launch() while a step is in flight: settle() it first"
        for s in self._worker_slices():
            self._set(s, SliceState.SETTLED, SliceState.PENDING)
        self._then, self._error = list(then), None
        self.launches += 1
        view = private_view(sharded.optimizer)
        # On a GPU the uploads run on a stream of their own, after what the compute stream queued so far (a gather
        # still reading a shard the step rewrites); each reader waits for its slices' upload event.
        queued = torch.cuda.current_stream(self.device).record_event() if self._stream is not None else None
        self._thread = threading.Thread(
            target=self._run, args=(_WorkerStepper(sharded, self, view), coefficient, queued), name="zero-host-step"
        )
        self._thread.start()

    def _worker_slices(self) -> list[ShardSlice]:
        return [s for s in self.slices if id(s) in self._worker]

    def _run(self, stepper: _WorkerStepper, coefficient: float, queued: torch.cuda.Event | None) -> None:
        device = torch.cuda.device(self.device) if self._stream is not None else nullcontext()
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        try:
            with device, stream, self.threads, record_function(self.profile_range):
                if queued is not None:
                    torch.cuda.current_stream(self.device).wait_event(queued)
                if len(self._worker) == len(self.slices):
                    self.runner.step(stepper, coefficient)
                else:
                    self.runner.step_where(stepper, coefficient, lambda s: id(s) in self._worker)
                self.copies.drain()  # masters are not written again before their uploads are over
        except BaseException as error:  # raised on the thread that waits ([Note: the host step across ...])
            self._error = error
        finally:
            with self._done:
                self._done.notify_all()

    def _move(self, slices: list[ShardSlice], before: SliceState, after: SliceState) -> None:
        with self._done:
            for s in slices:
                self._set(s, before, after)

    def _set(self, s: ShardSlice, before: SliceState, after: SliceState) -> None:
        state = self.states[id(s)]
        if state is not before:
            raise AssertionError(
                f"host step slice [{s.start}, {s.end}): cannot go {before.value} -> {after.value}, it is {state.value}"
            )
        self.states[id(s)] = after

    def _uploaded(self, slices: list[ShardSlice]) -> None:
        event = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None
        with self._done:
            for s in slices:
                self._set(s, SliceState.STEPPING, SliceState.UPLOADED)
                if event is not None:
                    self._events[id(s)] = event
            self._done.notify_all()

    def wait_for(self, shard: torch.Tensor) -> None:
        """Returns once every slice whose parameters overlap `shard` is uploaded (the current stream waits for the
        upload on a GPU); at once when no step is in flight."""
        if self._thread is None or not shard.numel():
            return
        where, lo, hi = _span(shard)
        needed = [s for (device, a, b), s in self._ranges if device == where and a < hi and lo < b]
        if not needed:
            return
        with self._done:
            if any(self.states[id(s)] is not SliceState.UPLOADED for s in needed):
                self.waits += 1
            while self._error is None and any(self.states[id(s)] is not SliceState.UPLOADED for s in needed):
                self._done.wait()
        self._raise_error()
        for event in {id(e): e for s in needed if (e := self._events.get(id(s))) is not None}.values():
            torch.cuda.current_stream(self.device).wait_event(event)

    def settle(self) -> None:
        """Waits for the whole step, then runs what follows it (`then` of `launch`); nothing when none is in flight."""
        thread = self._thread
        if thread is None:
            return
        thread.join()
        self._thread = None
        self._events.clear()
        self._raise_error()
        for s in self._worker_slices():
            self._set(s, SliceState.UPLOADED, SliceState.SETTLED)
        then, self._then = self._then, []
        for call in then:
            call()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if self._thread is not None:
                self._thread.join()
            self._thread, self._then = None, []
            self.states = {id(s): SliceState.SETTLED for s in self.slices}
            raise RuntimeError(
                "the offloaded optimizer step failed on its worker thread (the training state is now undefined: "
                f"reload a checkpoint; set {OVERLAP_ENV}=0 to step synchronously)"
            ) from error


def _span(tensor: torch.Tensor) -> tuple[str, int, int]:
    """The device and the bytes a contiguous tensor covers, as [first, end) addresses."""
    start = tensor.data_ptr()
    return str(tensor.device), start, start + tensor.numel() * tensor.element_size()
