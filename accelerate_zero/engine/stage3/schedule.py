"""UnitScheduler: when units are gathered, prefetched and released during forward and backward.

[Note: the execution-order trace]
The first forward records the order in which units run. Later forwards compare against it: while they follow it,
the next units are gathered ahead (forward: the following ones; backward: the preceding ones), up to
`stage3_prefetch_bucket_size` elements ahead and `stage3_max_live_parameters` gathered in total. A forward that
takes another order (a different branch, generation) stops prefetching for the rest of that forward and is
recorded as the new trace: correctness never depends on the trace, only the overlap does. The first change is
logged as a warning, later ones at debug level only.

[Note: a prefetch budget smaller than a unit]
DeepSpeed counts `stage3_prefetch_bucket_size` parameter by parameter, so a budget smaller than a decoder layer
still prefetches the first parameters of the next one; transformers' "auto" fills 0.9·hidden², about a twelfth of
a layer. Our units are gathered whole, so a positive budget always issues the next unit (a budget of 0 turns
prefetching off), and further units while they fit. `stage3_max_live_parameters` still caps what is gathered.

[Note: release after forward]
After a unit's forward (outside backward) it is released unless it will be used again in fewer than
`stage3_max_reuse_distance` elements (0 always releases) and keeping it stays within `stage3_max_live_parameters`, as in DeepSpeed.
When backward follows (grad enabled), a unit's next use is its backward, after the units that ran after it
have been used twice (their forward and their backward); without grad, the next forward. A unit recomputed
during backward (activation checkpointing) is kept until its gradients are done.

[Note: release after backward]
A unit whose parameters all train is released as soon as its gradient bucket is complete: every weight of it has
been used by then. A unit that also holds frozen parameters (a LoRA base projection beside its adapter, a frozen
norm) is not done then: autograd may still need a frozen weight to compute the gradient of the unit's input after
the last trainable gradient is ready. Such a unit's forward hooks its inputs that need a gradient (stage3/hooks.py
`_report_input_grads`); once backward computed all of their gradients the unit's backward is over, and the unit is
released when its bucket is complete too. When no input needs a gradient (the first layer of a model with frozen
embeddings, the root unit) it is released at the end of backward. Under reentrant activation checkpointing the first forward runs
without grad and the recomputation is what backward runs, so its inputs are the ones counted; under
non-reentrant checkpointing the first forward's inputs are counted and the recomputation's are not.

[Note: sub-module calls]
A forward does not have to start at the model: `model.model(...)`, `model.get_encoder()(...)` (which
encoder-decoder `generate()` calls) or `model.lm_head(h)` run modules whose parameters live in units that no unit
hook of theirs gathers (the root unit above all, gathered otherwise only by the model's own forward). Every such
module gets an entry hook (stage3/hooks.py `entry_units`): before its forward it gathers the units its parameters
live in, except the ones whose unit module it contains (their own hooks gather them when they run), and after it
releases them again; their gradients are re-gathered for backward by a hook on the call's outputs, exactly as for a
unit, and reach their buckets as usual. Inside a forward that already holds those units (the model's own forward,
a unit's forward) the entry hook does nothing, so nesting costs a few identity checks per call. A call that starts while no
forward runs begins a forward of its own, with its own execution-order trace, keyed by the module called. A module
inside a unit called alone (a probe of one layer) records no external uses (engine/stage3/external.py): its
post-forward hook is not always called, so a call that raises would leave the detector, a process-wide torch
function mode, and the eager stance it sets ([Note: compiling around ZeRO's hooks]) in place for every later torch
call of the process.
Gathering is a collective: every rank must run the same sequence of module forwards (as under DeepSpeed); a rank
that calls a different sub-module than the others waits for them until the process-group timeout.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.quantized_comm import BlockQuantization
from accelerate_zero.engine.stage3.external import ExternalUseDetector, param_index
from accelerate_zero.engine.stage3.param_unit import ParamUnit, UnitState
from accelerate_zero.engine.stores import ShardsInMemory, ShardStore


logger = logging.getLogger(__name__)


class TrainingPhase(enum.Enum):
    """What the hooks are running in ([Note: the training phase])."""

    IDLE = "idle"
    FORWARD = "forward"
    """A forward started at the model or at a sub-module ([Note: sub-module calls]) is running."""
    BACKWARD = "backward"
    """Autograd runs a backward pass; forward hooks now are recomputations (activation checkpointing)."""


# [Note: the training phase]
# The scheduler keeps its phase itself and asserts each transition: IDLE -> FORWARD when a forward begins, back to
# IDLE when it ends; -> BACKWARD when a backward reaches the first unit (its pre-backward hook), back to the phase it
# interrupted when autograd finishes the pass (a callback queued on autograd's engine, as FSDP2 does, so a plain
# `loss.backward()` the engine never sees ends it too). One case has no hook to announce it: a recomputation that
# runs before backward reached any unit's outputs (a model checkpointed as a whole, or a backward started inside a
# forward). Forward hooks therefore ask autograd whether a pass is running while the phase is not BACKWARD, and
# enter it then.
def _autograd_running() -> bool:
    return torch._C._current_graph_task_id() != -1


class UnitScheduler:
    """Drives `ParamUnit` state from the module and gradient hooks (see the notes above)."""

    def __init__(
        self,
        units: Sequence[ParamUnit],
        root: ParamUnit | None,
        dp: DataParallelGroup,
        stats: CommStats,
        *,
        secondary: DataParallelGroup | None = None,
        weight_quantization: BlockQuantization | None = None,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        use_all_reduce: bool = False,
        copies: HostCopies | None = None,
        shard_store: ShardStore | None = None,
    ) -> None:
        """`use_all_reduce`: `stage3_use_all_reduce_for_fetch_params`, gather with an all-reduce. `copies`: how
        shards kept in host memory reach the device (engine/host_copies.py). `shard_store`: where the units' shards
        live (engine/stores.py): the shards of the units gathered next are read ahead from it."""
        self.units, self.root, self.dp, self.stats, self.copies = list(units), root, dp, stats, copies
        self.secondary, self.weight_quantization = secondary, weight_quantization
        """hpZ's group ([Note: hpZ's secondary copy] in stage3/param_unit.py); None: no secondary copies."""
        self.prefetch_numel, self.max_live_numel = prefetch_numel, max_live_numel
        self.max_reuse_distance, self.use_all_reduce = max_reuse_distance, use_all_reduce
        self.trace: list[int] | None = None
        """The execution-order trace of the forward running (or last run); see `traces`."""
        self._input_grads: dict[int, int] = {}
        """Per unit with frozen parameters: inputs of its forward calls whose gradient backward has not computed."""
        self._grads_done: set[int] = set()
        """Units whose gradient bucket completed in the backward running."""
        self.traces: dict[int, list[int]] = {}
        """Per module a forward starts at (the model, or a sub-module called alone): its last trace."""
        self._entry_key = 0
        self._observed: list[int] = []
        self._on_trace = False
        self._trace_changes = 0
        self.peak_live_numel = 0
        self.gathers_on_demand = 0
        """Gathers issued when a unit was needed right away (forward or backward waited for the whole gather)."""
        self.gathers_prefetched = 0
        """Gathers issued ahead of the unit's use (from the trace)."""
        self.blocked_seconds = 0.0
        """Host time spent issuing and waiting for the gathers of units needed now (the time forward and backward
        stood still for parameters). Under NCCL `wait()` makes the stream wait, not the host: there the profiler
        measures it."""
        self.active: list[ParamUnit] = []
        """Units whose forward is running, innermost last."""
        self._detector: ExternalUseDetector | None = None
        self.shard_store = shard_store if shard_store is not None else ShardsInMemory()
        self.phase = TrainingPhase.IDLE
        self._resume_phase = TrainingPhase.IDLE  # the phase a backward interrupted
        self._before_unit_backward: list[Callable[[ParamUnit], None]] = []

    # ------------------------------------------------------------------ phase
    def _enter(self, phase: TrainingPhase, *allowed_from: TrainingPhase) -> None:
        assert self.phase in allowed_from, (
            f"stage 3 scheduler: cannot enter {phase.value} from {self.phase.value} "
            f"(expected {' or '.join(p.value for p in allowed_from)})"
        )
        self.phase = phase

    def in_backward(self) -> bool:
        """True while autograd runs a backward pass ([Note: the training phase])."""
        if self.phase is not TrainingPhase.BACKWARD and _autograd_running():
            self._begin_backward()
        return self.phase is TrainingPhase.BACKWARD

    def _begin_backward(self) -> None:
        resume = self.phase
        self._enter(TrainingPhase.BACKWARD, TrainingPhase.IDLE, TrainingPhase.FORWARD)
        self._resume_phase = resume
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        if self.phase is TrainingPhase.BACKWARD:  # end_backward() may have run already
            self._enter(self._resume_phase, TrainingPhase.BACKWARD)

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: ParamUnit) -> None:
        if unit is self.root and not self.in_backward():
            self._begin_forward(id(unit.module))
        self._run(unit)

    def post_forward(self, unit: ParamUnit) -> None:
        if self.active and self.active[-1] is unit:
            self.active.pop()
        if self.in_backward():
            return  # recomputed for backward: keep until the gradients are done
        if unit is self.root:
            self._end_forward()
        self._release_after_forward(unit)

    def enter(
        self, key: int, needed: Sequence[ParamUnit], record_external: bool = True
    ) -> tuple[list[ParamUnit], bool]:
        """A sub-module's forward starts ([Note: sub-module calls]): gathers the `needed` units not in use yet.

        `record_external`: a forward this call begins may watch for parameters used outside their unit (only where
        the module's post-forward hook runs even when the call raises). Returns the units entered (to pass to
        `leave`) and whether this call began a forward of its own.
        """
        in_use = self._held_ids()
        entered = [unit for unit in needed if id(unit) not in in_use]
        begins = bool(entered) and not self.active and not self.in_backward()
        if begins:
            self._begin_forward(key, record_external)
        for unit in entered:
            self._run(unit)
        for unit in needed:
            # Held by a call that raised (modules inside a unit have no always-called post hook) and released
            # since: gather it again.
            if unit.state is not UnitState.GATHERED:
                self._gather_now(unit)
        return entered, begins

    def leave(self, entered: Sequence[ParamUnit], began: bool) -> None:
        """The sub-module's forward ended: releases what `enter` gathered (kept while recomputing for backward)."""
        for unit in reversed(entered):
            assert self.active and self.active[-1] is unit, (
                f"stage 3 sub-module call left {unit} while {self.active[-1:]} runs: forwards must nest"
            )
            self.active.pop()
        if self.in_backward():
            return
        if began:
            self._end_forward()
        for unit in reversed(entered):
            self._release_after_forward(unit)

    def _run(self, unit: ParamUnit) -> None:
        recompute = self.in_backward()
        if not recompute:
            self._follow_trace(unit)
        self.active.append(unit)
        for needed in (unit, *unit.external):
            self._gather_now(needed)
        if not recompute and self._on_trace:
            assert self.trace is not None
            self._prefetch(self.trace[len(self._observed) :])

    def in_use(self, units: Sequence[ParamUnit]) -> bool:
        """True when every one of `units` is held by a forward running (a nested sub-module call needs nothing)."""
        active = self.active
        return all(
            unit.state is UnitState.GATHERED and any(unit is a or unit in a.external for a in active) for unit in units
        )

    def _held_ids(self) -> set[int]:
        return {id(u) for active in self.active for u in (active, *active.external)}

    def _release_after_forward(self, unit: ParamUnit) -> None:
        in_use = self._held_ids()
        # hpZ: a unit released before its backward keeps its secondary copy ([Note: hpZ's secondary copy]).
        keep_secondary = self.secondary if torch.is_grad_enabled() else None
        for done in (unit, *unit.external):
            if id(done) not in in_use and not self._keep_after_forward(done):
                done.reshard(keep_secondary=keep_secondary)

    def _begin_forward(self, key: int, record_external: bool = True) -> None:
        # FORWARD too: a forward that raised never ended.
        self._enter(TrainingPhase.FORWARD, TrainingPhase.IDLE, TrainingPhase.FORWARD)
        self._entry_key, self.trace = key, self.traces.get(key)
        self._observed = []
        self._on_trace = self.trace is not None
        self.active.clear()
        if not record_external:
            self.end_recording()
        elif self.trace is None and self._detector is None:
            self._detector = ExternalUseDetector(param_index(self.units), self.active, self._gather_now)
            self._detector.__enter__()

    def _follow_trace(self, unit: ParamUnit) -> None:
        position = len(self._observed)
        self._observed.append(unit.index)
        if self._on_trace and (
            self.trace is None or position >= len(self.trace) or self.trace[position] != unit.index
        ):
            self._on_trace = False

    def end_recording(self) -> None:
        """Leaves the recording forward's detector and eager stance, process-wide state (also for a forward that
        raised and never ended: `engine.destroy()` calls it)."""
        if self._detector is not None:
            detector, self._detector = self._detector, None
            detector.__exit__(None, None, None)

    def _end_forward(self) -> None:
        self._enter(TrainingPhase.IDLE, TrainingPhase.FORWARD)
        self.end_recording()
        observed = self._observed
        if self.trace is not None and observed != self.trace:
            self._trace_changes += 1
            log = logger.warning if self._trace_changes == 1 else logger.debug
            log(
                "accelerate_zero stage 3: the order in which modules ran changed (%d units, was %d); prefetching "
                "follows the new order from the next forward (further changes are logged at debug level)",
                len(observed),
                len(self.trace),
            )
        self.trace = self.traces[self._entry_key] = observed
        self._on_trace = False

    def _keep_after_forward(self, unit: ParamUnit) -> bool:
        if self.trace is None or unit.index not in self.trace:
            return False
        last = len(self.trace) - 1 - self.trace[::-1].index(unit.index)
        later = self.trace[last + 1 :]
        numel = {u.index: u.numel for u in self.units}
        after = sum(numel[i] for i in set(later))
        backward_follows = torch.is_grad_enabled()
        distance = 2 * after if backward_follows else sum(numel.values()) - unit.numel
        return distance < self.max_reuse_distance and self.live_numel() <= self.max_live_numel

    # ----------------------------------------------------------------- backward
    def register_before_unit_backward(self, hook: Callable[[ParamUnit], None]) -> None:
        """`hook(unit)` runs when a unit's backward begins, before its gradients exist (the gradient reducer makes
        room for them: [Note: full-size gradient buffers alive in backward] in engine/grad_reduce.py)."""
        self._before_unit_backward.append(hook)

    def pre_backward(self, unit: ParamUnit) -> None:
        if self.phase is not TrainingPhase.BACKWARD:  # the first unit this backward reaches
            self._begin_backward()
        for hook in self._before_unit_backward:
            hook(unit)
        for needed in (unit, *unit.external):
            self._gather_now(needed)
        if self.trace is not None and unit.index in self.trace:
            last = len(self.trace) - 1 - self.trace[::-1].index(unit.index)
            # Units whose backward is over are not fetched again (the root unit runs first in forward but its
            # gradients can complete early, an untied LM head's final norm).
            self._prefetch(index for index in reversed(self.trace[:last]) if index not in self._grads_done)

    def expects_input_grads(self, unit: ParamUnit, count: int) -> bool:
        """Whether the `count` inputs needing a gradient of a forward call of `unit` must report when backward
        computed their gradients ([Note: release after backward]); counts them when so."""
        if not unit.has_frozen:
            return False
        if self.in_backward() and self._input_grads.get(unit.index, 0) > 0:
            return False  # a non-reentrant recomputation: the first forward's inputs are the ones backward reaches
        self._input_grads[unit.index] = self._input_grads.get(unit.index, 0) + count
        return True

    def input_grads_done(self, unit: ParamUnit) -> None:
        """Backward computed the gradient of one input of a forward call of `unit`."""
        if self._input_grads.get(unit.index, 0) > 0:  # 0: reported after an end_backward (a plain second backward)
            self._input_grads[unit.index] -= 1
            self._release_after_backward(unit)

    def post_backward(self, unit: ParamUnit) -> None:
        """The unit's gradient bucket is complete."""
        self._grads_done.add(unit.index)
        self._release_after_backward(unit)

    def _release_after_backward(self, unit: ParamUnit) -> None:
        if unit.has_frozen:
            if unit.index not in self._input_grads or self._input_grads[unit.index] > 0:
                return  # a frozen weight may still be needed ([Note: release after backward])
            if unit.bucket is not None and unit.index not in self._grads_done:
                return
        unit.reshard()
        unit.drop_secondary()

    def end_backward(self) -> None:
        """The engine's backward returned (or its step came): nothing of the backward is kept."""
        if self.phase is TrainingPhase.BACKWARD:
            self._enter(self._resume_phase, TrainingPhase.BACKWARD)
        self._input_grads.clear()
        self._grads_done.clear()
        self.release_all()

    def prefetch_ahead(self) -> None:
        """Between an optimizer step whose host step is still running and the next forward: starts gathering the
        first units of the last forward's order, within the prefetch budget, each as soon as its own slices are
        stepped ([Note: the host step across the step boundary] in engine/step_in_flight.py)."""
        trace = self.traces.get(self._entry_key)
        if self.phase is TrainingPhase.IDLE and trace:
            self._prefetch(trace)

    def release_all(self) -> None:
        for unit in self.units:
            unit.reshard()
            unit.drop_secondary()

    # ------------------------------------------------------------------ helpers
    def live_numel(self) -> int:
        return sum(u.numel for u in self.units if u.state is not UnitState.SHARDED)

    def _gather_now(self, unit: ParamUnit) -> None:
        if unit.state is UnitState.SHARDED and unit.numel > 0:
            self.gathers_on_demand += 1
        start = time.perf_counter()
        self._unshard(unit)
        unit.wait_for_unshard()
        self.blocked_seconds += time.perf_counter() - start
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel())

    def _unshard(self, unit: ParamUnit) -> None:
        unit.unshard(self.dp, self.stats, self.use_all_reduce, self.copies, self.secondary, self.weight_quantization)

    def _prefetch(self, upcoming: Iterable[int]) -> None:
        budget, live = self.prefetch_numel, self.live_numel()
        by_index = {u.index: u for u in self.units}
        upcoming = list(upcoming)
        self.shard_store.read_ahead([flat for i in upcoming for flat in by_index[i].flats])
        ahead = 0  # upcoming units gathered already, or issued here
        for index in dict.fromkeys(upcoming):
            unit = by_index[index]
            if unit.state is not UnitState.SHARDED:
                budget -= unit.numel  # an earlier call (another hook of the same unit) prefetched it
                ahead += 1
                continue
            # [Note: a prefetch budget smaller than a unit]: the next unit is always issued when the budget is
            # positive, later ones while they fit.
            fits = unit.numel <= budget or (ahead == 0 and self.prefetch_numel > 0)
            if not fits or live + unit.numel > self.max_live_numel:
                break
            self._unshard(unit)
            self.gathers_prefetched += 1
            budget -= unit.numel
            live += unit.numel
            ahead += 1
        self.peak_live_numel = max(self.peak_live_numel, live)
