"""GradReducer: autograd hooks feed gradients into buckets and launch their reductions while backward runs.

[Note: collective order is the same on every rank]
Each rank must issue the same collectives in the same order. Buckets therefore have one fixed global order (the
order backward fills them) and a bucket is launched only after every bucket before it. A bucket whose parameters
did not all receive a gradient on this rank (an unused parameter) holds back the ones after it until
`end_backward()`, which launches every bucket that was not launched yet, zeros included, then relaunches the
buckets that received a late gradient ([Note: a gradient that arrives after its bucket was reduced]).

Backward passes started by `ZeroEngine.backward` are "sessions": the engine says whether this backward ends on the
gradient-accumulation boundary, and the buckets' reduce mode decides whether it is reduced now
(`ReduceMode.reduces_every_micro_step`: always at stages 2 and 3, where it is what keeps the gradients and at stage 3
the gathered units from staying full-size between micro-steps; at stages 0 and 1 only on the boundary). A plain
`loss.backward()` outside a session still accumulates correctly; its reduction then happens in `finish_step()`.

[Note: full-size gradient buffers alive in backward]
At stages 2 and 3 a bucket's full-size gradient lives only while the bucket fills and while its reduction is in
flight (a stage-3 unit's: a decoder layer's size, beside the gathered units). `max_in_flight` bounds those buffers,
the bucket filling included: when a bucket's first gradient arrives, the oldest reductions finish until at most
`max_in_flight - 1` are in flight, and a launch finishes the oldest before it starts, not after (one more reduction
would otherwise hold its buffers for a moment). With 2 this is the double buffering of DeepSpeed's reduction
buckets: one bucket fills while the previous one is reduced. Before, two reductions stayed in flight while the next
bucket filled, and a third for a moment at each launch: on a Llama with 28 MB decoder layers that was three layers'
gradients and three received copies beside the gathered units (issue 44, item 12; bench/README.md, user_load.py).
Autograd allocates a parameter's gradient before any hook sees it, so counting from the first gradient hook leaves
one more full-size gradient alive while the next bucket's gradients are computed: at a stage-3 unit's boundary the
two reductions in flight beside the unit's fresh gradient (issue 51, item 5: 4.2 MB above FSDP2's peak on a stack of
Linear(1024) units). Where the next bucket is known before its gradients exist, a stage-3 unit whose backward begins
(stage3/schedule.py `pre_backward`), `gradients_coming` makes room then. Stage 2 has no such signal; its buckets hold
many parameters, so one parameter's gradient is a small part of one.
A buffer given back is kept for the next bucket of its size ([Note: temporaries reused in host memory] in
engine/scratch.py) unless no bucket still to fill in this backward (after the furthest one that received a
gradient, in launch order) has that size, as the last decoder layers' buffers before the embeddings reduce: then it
goes back at once.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.engine import collectives
from accelerate_zero.engine.buckets import BucketState, GradBucket, GradScaling
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.quantized_comm import QuantizedReduceScatter
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.shard_plan import ParamSlot


# [Note: reductions in flight on gloo]
# `overlap_comm` keeps reductions in flight while backward goes on: two on NCCL, where the collective runs on its
# own stream while the next bucket's gradients are computed (FSDP2 on CUDA holds its reduce-scatter input the same
# way). Our gloo reduce-scatter ([Note: reduce-scatter on gloo] in engine/collectives.py) only has its first round in
# flight on return; the others run in `wait()`, so a reduction in flight overlaps a quarter of a stage-3 unit's
# messages (one round of a large bucket), and holds its whole full-size gradient for it. Beside the next unit's
# gradient and the gathered units that was a unit's gradient above FSDP2's peak on the CPU (issue 51, item 5;
# FSDP2 reduce-scatters synchronously there). At stage 3 on gloo one reduction stays in flight, until the next
# unit's gradients are about to be produced (`gradients_coming`): its first round overlaps the rest of the unit's
# backward. DeepSpeed backs it: on its CPU accelerator (no streams) `overlap_comm` reduces every bucket synchronously
# in the gradient hook that fills it. Measured in bench/README.md (accum_peaks.py); the CPU time is the same (a wait
# costs none). Stage 2 keeps two: there the rule raised the backward's peak (phase_peaks.py, 66.9M Llama, W = 4,
# second step: 744 -> 795 MB, 777 with its buckets keeping autograd's gradients; not traced further: its buckets are
# few and large, and no signal announces the next one before its gradients exist).
def reductions_in_flight(
    overlap_comm: bool, buckets: Sequence[GradBucket], dp: DataParallelGroup, use_reduce_scatter: bool, units: bool
) -> int:
    """`GradReducer`'s `max_in_flight` for a config's `overlap_comm` ([Note: reductions in flight on gloo]);
    `units`: stage 3 (the buckets are gather units')."""
    if not overlap_comm:
        return 0
    on_gloo = dp.world_size > 1 and dp.backend == "gloo" and use_reduce_scatter
    return 1 if units and on_gloo and any(bucket.mode.reduces_every_micro_step for bucket in buckets) else 2


@dataclass
class _Session:
    """Bookkeeping of one backward pass started by the engine."""

    boundary: bool
    """This backward ends the accumulation cycle."""
    eager: bool
    """Launch reductions as buckets fill (else only accumulate)."""
    remaining: list[int]
    """Per bucket (in launch order): parameters that have not delivered a gradient yet."""
    arrived: list[set[int]]
    next_launch: int = 0
    launched: set[int] = field(default_factory=set)


class GradReducer:
    """Owns the gradient hooks and the bucket reduction schedule (see the module note)."""

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        locations: dict[nn.Parameter, tuple[int, ParamSlot]],
        dp: DataParallelGroup,
        stats: CommStats,
        scaling: GradScaling,
        *,
        use_reduce_scatter: bool,
        max_in_flight: int,
        replicate: DataParallelGroup | None = None,
        quantized: QuantizedReduceScatter | None = None,
        ignore_unused_parameters: bool = True,
        param_names: dict[nn.Parameter, str] | None = None,
        on_bucket_complete: Callable[[int], None] | None = None,
        scratch: ScratchBuffers | None = None,
        keeps_autograd_grads: bool = False,
    ) -> None:
        """
        Args:
            buckets: every bucket of every param group, in launch order.
            locations: for each trainable parameter, (index into `buckets`, its slot).
            max_in_flight: reductions allowed in flight at once; 0 waits for each one right away (no overlap). Where
                the full-size gradient is transient (stages 2/3) it bounds the full-size buffers alive, the bucket
                filling included ([Note: full-size gradient buffers alive in backward]).
            replicate: the ranks holding the same shards (replicate x shard, engine/layout.py): each reduced
                shard is summed over them too; None: no replicas.
            quantized: qgZ's reduce-scatter for the stage 2/3 buckets (engine/quantized_comm.py).
            ignore_unused_parameters: False makes a reducing backward that left a parameter without gradient
                raise (DeepSpeed's `zero_optimization.ignore_unused_parameters`).
            param_names: names for error messages.
            on_bucket_complete: called with a bucket's index once all its parameters delivered their gradient in
                a reducing backward (stage 3 releases the unit's gathered parameters there).
            scratch: the temporaries the buckets share (for memory accounting; each bucket holds it too).
            keeps_autograd_grads: buckets may keep autograd's gradients and reduce-scatter them as pieces where the
                collective can read them ([Note: a bucket that keeps autograd's gradients] in engine/buckets.py);
                stage 3 only (the note says why not stage 2).
        """
        self.buckets, self.locations = list(buckets), locations
        self.dp, self.stats, self.scaling, self.replicate = dp, stats, scaling, replicate
        self.quantized = quantized
        self.use_reduce_scatter, self.max_in_flight = use_reduce_scatter, max_in_flight
        self.ignore_unused_parameters, self.param_names = ignore_unused_parameters, param_names or {}
        self.on_bucket_complete = on_bucket_complete
        self.scratch = scratch if scratch is not None else ScratchBuffers(torch.device("cpu"), reuse=False)
        self._in_flight: collections.deque[GradBucket] = collections.deque()
        self._session: _Session | None = None
        self._grads_outside_session = False
        self._handles: list[RemovableHandle] = []
        modes = {b.mode for b in self.buckets}
        if len(modes) > 1:
            raise ValueError(f"buckets of one engine must share a reduce mode, got {sorted(m.value for m in modes)}")
        self.partitioned = any(mode.reduces_every_micro_step for mode in modes)
        """Every backward reduces (stages 2 and 3); else only the one ending on the accumulation boundary."""
        self.peak_transient_bytes = 0
        # Per bucket: the (numel, dtype) of the buckets after it in launch order ([Note: full-size gradient buffers
        # alive in backward]); `_furthest`: the last bucket that received a gradient in this backward.
        self._sizes_after: list[frozenset[tuple[int, torch.dtype]]] = []
        later: set[tuple[int, torch.dtype]] = set()
        for bucket in reversed(self.buckets):
            self._sizes_after.append(frozenset(later))
            later.add((bucket.plan.numel, bucket.grad_dtype))
        self._sizes_after.reverse()
        self._furthest = -1
        self._reads_pieces = [keeps_autograd_grads and self._reduces_pieces(bucket) for bucket in self.buckets]
        """Per bucket: it keeps autograd's gradients and reduce-scatters them as pieces ([Note: a bucket that keeps
        autograd's gradients] in engine/buckets.py); the same on every rank, as the messages depend on it."""

    def _reduces_pieces(self, bucket: GradBucket) -> bool:
        own = bucket.reduce_group is not None
        return (
            bucket.mode.reduces_every_micro_step
            and self.use_reduce_scatter
            and (own or self.quantized is None)
            and bucket.comm_dtype == bucket.grad_dtype
            and self.scaling.pre == 1.0
            and collectives.reads_pieces(bucket.reduce_group if own else self.dp)
        )

    def register_hooks(self) -> None:
        for param in self.locations:
            self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ backward
    def begin_backward(self, boundary: bool) -> None:
        """Starts a session; `boundary`: this backward ends the accumulation cycle (the next step steps)."""
        if self._session is not None:
            raise RuntimeError("begin_backward() called twice without end_backward(): is a backward still running?")
        self._furthest = -1
        self._session = _Session(
            boundary=boundary,
            eager=boundary or self.partitioned,
            remaining=[len(b.plan.slots) for b in self.buckets],
            arrived=[set() for _ in self.buckets],
        )

    def abort_backward(self) -> None:
        """Forgets the session of a backward that raised, without launching anything."""
        self._session = None

    def end_backward(self) -> None:
        session, self._session = self._session, None
        if session is None or not session.eager:
            return
        if not self.ignore_unused_parameters:
            self._raise_for_unused(session)
        for index in range(session.next_launch, len(self.buckets)):
            self._launch(index)
        for index in sorted(session.launched):
            if self.buckets[index].state is BucketState.ACCUMULATING:
                self._launch(index)
        self._drain()
        if self.partitioned:
            # Every bucket of this micro-step is reduced: only the gradient shard lives on to the next one
            # ([Note: nothing but the gradient shard survives a micro-step] in engine/scratch.py).
            self.scratch.clear()

    def _raise_for_unused(self, session: _Session) -> None:
        unused = [
            self.param_names.get(param, f"<parameter of shape {tuple(param.shape)}>")
            for param, (index, slot) in self.locations.items()
            if slot.param_index not in session.arrived[index]
        ]
        if unused:
            raise RuntimeError(
                f"these parameters got no gradient in this backward: {sorted(unused)}; set "
                "zero_optimization.ignore_unused_parameters to true (the default) to reduce zeros for them, or "
                "make them take part in the loss. Other ranks may now wait for this one until the timeout."
            )

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        index, slot = self.locations[param]
        bucket = self.buckets[index]
        self._furthest = max(self._furthest, index)
        if self.partitioned and not bucket.filling:
            # A full-size buffer comes alive (this gradient, or the one it is copied into): the reductions in flight
            # beyond the bound finish first and give theirs back ([Note: full-size gradient buffers alive in
            # backward]).
            self._finish_beyond(max(self.max_in_flight - 1, 0))
        bucket.add_grad(slot, grad, keep=self._reads_pieces[index])
        self._track_transient_bytes()
        session = self._session
        if session is None:
            self._grads_outside_session = True
            return
        if session.eager and slot.param_index not in session.arrived[index]:
            session.arrived[index].add(slot.param_index)
            session.remaining[index] -= 1
            if session.remaining[index] == 0 and self.on_bucket_complete is not None:
                self.on_bucket_complete(index)
            while session.next_launch < len(self.buckets) and session.remaining[session.next_launch] == 0:
                self._launch(session.next_launch)
                session.next_launch += 1

    def gradients_coming(self, bucket: GradBucket | None) -> None:
        """Autograd is about to compute `bucket`'s gradients (a stage-3 unit's backward begins; None: a unit with
        nothing to train): the reductions in flight beyond the bound finish now, before those gradients exist
        ([Note: full-size gradient buffers alive in backward])."""
        if self.partitioned and bucket is not None and not bucket.filling:
            self._finish_beyond(max(self.max_in_flight - 1, 0))
            # The temporaries they gave back would sit beside those gradients, at the backward's peak; the bucket's
            # own reduction takes them again once its gradients are there.
            self.scratch.clear()

    def _launch(self, index: int) -> None:
        # At most `max_in_flight` reductions hold their buffers at any moment: the oldest is finished before the next
        # one starts (and gives its buffers back for it to reuse), not after.
        self._finish_beyond(max(self.max_in_flight - 1, 0))
        bucket = self.buckets[index]
        own = bucket.reduce_group is not None  # a split layer's experts: reduced over their own ranks
        bucket.start_reduce(
            bucket.reduce_group if own else self.dp,
            self.stats,
            self.scaling,
            self.use_reduce_scatter,
            async_op=True,
            replicate=None if own else self.replicate,
            quantized=None if own else self.quantized,
            pieces=self._reads_pieces[index],
        )
        if self._session is not None:
            self._session.launched.add(index)
        self._in_flight.append(bucket)
        if self.max_in_flight == 0:
            self._drain()

    def _finish_beyond(self, count: int) -> None:
        """Finishes the oldest reductions until at most `count` are in flight."""
        while len(self._in_flight) > count:
            bucket = self._in_flight.popleft()
            bucket.finish_reduce()
            key = (bucket.plan.numel, bucket.grad_dtype)
            if self.partitioned and self._furthest >= 0 and key not in self._sizes_after[self._furthest]:
                self.scratch.drop(*key)  # every bucket still to fill has another size

    def _drain(self) -> None:
        self._finish_beyond(0)

    def _track_transient_bytes(self) -> None:
        if self.partitioned:
            live = sum(bucket.full_size_bytes() for bucket in self.buckets)
            self.peak_transient_bytes = max(self.peak_transient_bytes, live)

    # ---------------------------------------------------------------------- step
    def finish_step(self) -> None:
        """Makes every bucket's averaged gradient available; called at the accumulation boundary."""
        if self._session is not None:
            self.end_backward()
        if self.partitioned:
            # Stage 2 reduced every session already; only gradients from a plain loss.backward() are left.
            pending = self._grads_outside_session
            to_reduce = range(len(self.buckets)) if pending else ()
        else:
            to_reduce = [i for i, b in enumerate(self.buckets) if b.state is not BucketState.REDUCED]
        for index in to_reduce:
            self._launch(index)
        self._drain()
        self._grads_outside_session = False
        # Every reduction of this step is done: what the optimizer step, and whatever runs until the next backward
        # (evaluation, generation, a checkpoint), allocate does not have the step's temporaries held beside it.
        self.scratch.clear()

    def zero_grad(self) -> None:
        self._drain()
        for bucket in self.buckets:
            bucket.zero()
        self._grads_outside_session = False
        self.scratch.clear()

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [t for bucket in self.buckets for t in bucket.gradient_tensors()]

    def transient_tensors(self) -> list[torch.Tensor]:
        return [t for bucket in self.buckets for t in bucket.transient_tensors()]

    def cached_tensors(self) -> list[torch.Tensor]:
        """Temporaries given back and kept for the next bucket of this backward ([Note: temporaries reused in host
        memory])."""
        return self.scratch.cached_tensors()
