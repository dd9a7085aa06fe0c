"""GradBucket: one bucket's gradient storage and its reduction, with an explicit lifecycle.

[Note: how a bucket's gradient is reduced, per stage]
- ALL_REDUCE (stage 0): the bucket's full local gradient is averaged in place on every rank.
- SCATTER_IN_PLACE (stage 1): the full local gradient is kept; the reduce-scatter writes the averaged slice this
  rank owns over its own slice of the same buffer (no second buffer). The other slices then hold stale local data.
- SCATTER_TO_SHARD (stage 2): the full gradient exists only while the bucket is being filled and reduced; the
  averaged owned slice is added to a shard-sized gradient that accumulates over micro-steps, then the full buffer
  is released. This is what makes stage 2 hold 1/W of the gradients.

[Note: reducing over replicas]
Under replicate x shard (engine/layout.py) a shard group's reduce-scatter sums the gradients of its own ranks only;
the ranks holding the same shard in the other groups each have the sum of theirs. Summing those partial sums over
the replicas (an all-reduce of the 1/s shard, between nodes when a shard group is a node) gives every replica the
sum over all W ranks; the scaling divides by W. It runs at each reduction, as FSDP2's HSDP does, so that gradient
accumulation and a shard kept in host memory or on NVMe see one finished sum, as with one group.

[Note: a gradient that arrives after its bucket was reduced]
Reentrant activation checkpointing or a second backward can deliver a gradient to a bucket that was already
reduced in this step. Reduction is linear, so the late part is reduced again and added: stage 2 simply fills a
fresh full buffer; stage 0 adds onto the averaged buffer A (every rank holds A, and averaging A + g_r over ranks
gives A + mean(g)); stage 1 multiplies its owned slice by W and zeroes the stale slices, so the next average
gives back its slice of A plus the late mean.

[Note: the first gradient of a cycle is copied, not added]
A full-size gradient buffer is not zeroed when a cycle starts (a pass over every element per bucket per micro-step
at stages 2/3, per step at stages 0/1): each parameter's first gradient is copied into its slot, later ones are
added, and before the buffer is read (a reduction, the step) the slots that got no gradient are zeroed. Padding is
zeroed once, when the buffer is allocated, and stays zero (every rank reduces zeros there).

[Note: a bucket that keeps autograd's gradients]
At stage 3 on gloo (`collectives.reads_pieces`) a bucket does not copy its gradients into a full-size buffer: it
keeps each parameter's gradient as autograd produced it (the reducer took the only reference, `param.grad = None`)
and the reduce-scatter reads them where they are ([Note: a reduce-scatter of pieces] in engine/collectives.py),
writing this rank's averaged chunk over the elements that hold it. The copy held a full-size buffer beside each
parameter's fresh gradient while it was copied, beside the reduction in flight: three full-size gradients at a
stage-3 unit's boundary where two are needed (issue 51, item 5), and a pass over the bucket per micro-step. A second
gradient of a parameter in the same cycle is added to the kept one; a gradient of another dtype or that is a view
into a larger tensor is kept as a copy of its own. When the reduction cannot read pieces (NCCL reduces one
contiguous buffer; a cast for a 16-bit reduction, pre-scaling or qgZ rewrite the whole bucket), nothing is kept:
the bucket copies as before, which is also what FSDP2 does on CUDA (its reduce-scatter input). Nor at stage 2
(`GradReducer`'s `keeps_autograd_grads`): there it was measured only together with one reduction in flight, which
raised stage 2's peak ([Note: reductions in flight on gloo] in engine/grad_reduce.py), and its buckets are large:
the chunk a rank keeps, assembled from several pieces, is a copy of 1/W of the bucket beside all of it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats, Pending
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.kept_grads import ArenaSlot, DeviceShardGradient, KeptGradient, ReducedInPlace
from accelerate_zero.engine.quantized_comm import QuantizedReduceScatter
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.shard_plan import BucketPlan, ParamSlot


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """The tensor is all of its storage: keeping it keeps nothing else alive."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


class ReduceMode(enum.Enum):
    ALL_REDUCE = "all_reduce"
    SCATTER_IN_PLACE = "scatter_in_place"
    SCATTER_TO_SHARD = "scatter_to_shard"

    @property
    def reduces_every_micro_step(self) -> bool:
        """Whether a backward reduces this mode's buckets on every micro-step, not only on the accumulation
        boundary. SCATTER_TO_SHARD keeps only a shard-sized gradient between micro-steps (stages 2 and 3: the
        full-size gradient, and at stage 3 the gathered unit, are released as soon as the bucket is reduced);
        the other modes keep the full local gradient anyway, so reducing once per optimizer step moves less."""
        return self is ReduceMode.SCATTER_TO_SHARD


KeptFor = Callable[[BucketPlan, ReduceMode], KeptGradient | None]
"""Chooses a bucket's home when it is built (engine/assemble.py); None: the compute device (GradBucket's default)."""


class BucketState(enum.Enum):
    EMPTY = "empty"
    """No local gradient since the last zero (stage 2: also after each reduction)."""
    ACCUMULATING = "accumulating"
    """Holds local gradients not reduced yet."""
    REDUCING = "reducing"
    """A collective is in flight; `finish_reduce()` before touching the buffers."""
    REDUCED = "reduced"
    """Holds this step's averaged gradient (stages 0 and 1)."""


class GradScaling:
    """Factors applied around the collective so that it averages over ranks exactly as DDP does.

    A 16-bit reduction divides by W before the sum (like DeepSpeed: the sum stays in range). An fp32 reduction cannot
    overflow, so it divides after the sum: at stages 1-3 that scales the 1/W slice this rank keeps instead of the whole
    bucket. With `prescale_gradients` the gradient is divided by `gradient_predivide_factor` before and by W/factor
    after. `pre * post` is always 1/W.
    """

    def __init__(
        self, world_size: int, prescale_gradients: bool, predivide_factor: float, comm_dtype: torch.dtype
    ) -> None:
        if prescale_gradients:
            self.pre, self.post = 1.0 / predivide_factor, predivide_factor / world_size
        elif comm_dtype == torch.float32:
            self.pre, self.post = 1.0, 1.0 / world_size
        else:
            self.pre, self.post = 1.0 / world_size, 1.0


class GradBucket:
    """Gradient storage and reduction for one `BucketPlan` (see the notes above)."""

    plan: BucketPlan
    mode: ReduceMode
    state: BucketState
    grad: torch.Tensor | None  # 1D, plan.numel: the full local gradient (stages 0/1: kept; stage 2: transient)
    kept: KeptGradient  # where the averaged slice this rank steps is kept ([Note: a reduced gradient has one home])

    def __init__(
        self,
        plan: BucketPlan,
        mode: ReduceMode,
        rank: int,
        grad_dtype: torch.dtype,
        comm_dtype: torch.dtype,
        device: torch.device,
        storage: ArenaSlot | None,
        params: list[torch.nn.Parameter],
        kept: KeptGradient | None = None,
        scratch: ScratchBuffers | None = None,
    ) -> None:
        """`storage` (`contiguous_gradients`): the arena slot of this bucket's gradient, at stages 0/1 the full-size
        buffer the cycle accumulates into, at stages 2/3 the shard ([Note: gradients live from the first backward to
        the optimizer step] in engine/kept_grads.py). Otherwise the full-size gradient is taken from `scratch` on
        first use and given back after each step (stages 2/3: after each reduction). `params` is
        the list `ParamSlot.param_index` indexes. `kept`: where the averaged slice goes (engine/kept_grads.py);
        default: the compute device. `scratch`: where the full-size temporaries come from ([Note: temporaries reused
        in host memory]); default: fresh allocations."""
        self.plan, self.mode, self.rank, self.params = plan, mode, rank, params
        self.grad_dtype, self.comm_dtype, self.device = grad_dtype, comm_dtype, device
        to_shard = mode is ReduceMode.SCATTER_TO_SHARD
        if kept is None:
            if to_shard:
                kept = DeviceShardGradient(plan.shard_numel, grad_dtype, device, storage)
            else:
                kept = ReducedInPlace(plan.numel if mode is ReduceMode.ALL_REDUCE else plan.shard_numel)
        if to_shard:
            storage = None  # the shard gradient is the home's
        self._slot = storage  # stages 0/1: where the full-size gradient is cut from while it lives
        assert kept.numel == (plan.numel if mode is ReduceMode.ALL_REDUCE else plan.shard_numel), "kept slice size"
        self.kept = kept
        self.scratch = scratch if scratch is not None else ScratchBuffers(device, reuse=False)
        self.state = BucketState.EMPTY
        self.reduce_group: DataParallelGroup | None = None
        """The ranks this bucket is sharded and reduced over when they are not the engine's (a split layer's
        experts: [Note: expert parallelism in the engine] in engine/experts/partition.py); None: the engine's."""
        self.grad: torch.Tensor | None = None
        self._has_reduced = False
        """`kept` holds this step's averaged gradient (else it holds an earlier step's, or nothing)."""
        self._pending: Pending | None = None
        self._unwritten: set[int] | None = None  # slots not written since the buffer was (re)used, see the note
        self._adopted = False  # `grad` is autograd's ([Note: a single-tensor bucket reduces autograd's gradient ...])
        self._held: dict[int, torch.Tensor] | None = None
        """Per slot (`param_index`): its gradient as autograd produced it ([Note: a bucket that keeps autograd's
        gradients]); None while the cycle holds none (or copies into `grad`)."""
        self._comm_buffer: torch.Tensor | None = None
        self._comm_pieces: list[torch.Tensor] | None = None  # a reduction of pieces in flight: what it reads
        self._scaling: GradScaling | None = None
        self._replicate: DataParallelGroup | None = None
        self._stats: CommStats | None = None

    # ----------------------------------------------------------------- accumulation
    def add_grad(self, slot: ParamSlot, grad: torch.Tensor, keep: bool = False) -> bool:
        """Adds one parameter's gradient; returns True when the bucket had already been reduced in this step.
        `keep`: this bucket's reduction reads pieces (stage 3 on gloo): keep autograd's gradient instead of
        copying it ([Note: a bucket that keeps autograd's gradients])."""
        late = self.state in (BucketState.REDUCING, BucketState.REDUCED)
        if late and self.mode is not ReduceMode.SCATTER_TO_SHARD:
            # What `kept` holds is stale now (and a copy into it may still read `grad`): the bucket reduces again.
            self.kept.settle()
            self._has_reduced = False
        if self.state is BucketState.REDUCING:
            self.finish_reduce()
        if self.state is BucketState.REDUCED:
            self._reopen()
        if keep and self.grad is None and self.mode is ReduceMode.SCATTER_TO_SHARD:
            self._keep(slot, grad)
            self.state = BucketState.ACCUMULATING
            return late
        if self._adopts(slot, grad):
            # [Note: a single-tensor bucket reduces autograd's gradient itself]
            self.grad, self._unwritten, self._adopted = grad.view(-1), None, True
            self.state = BucketState.ACCUMULATING
            return late
        view = self._full_grad(written=False)[slot.offset : slot.offset + slot.numel]
        if self._unwritten is not None and slot.param_index in self._unwritten:
            self._unwritten.discard(slot.param_index)
            view.copy_(grad.reshape(-1))  # [Note: the first gradient of a cycle is copied, not added]
        else:
            view.add_(grad.reshape(-1))
        self.state = BucketState.ACCUMULATING
        return late

    def _keep(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        held = self._held if self._held is not None else {}
        self._held = held
        flat = grad.reshape(-1)
        earlier = held.get(slot.param_index)
        if earlier is not None:
            earlier.add_(flat)
        elif flat.dtype == self.grad_dtype and flat.device == self.device and _owns_its_storage(flat):
            held[slot.param_index] = flat
        else:  # a cast, or a view that would keep a larger tensor alive
            held[slot.param_index] = torch.empty(flat.numel(), dtype=self.grad_dtype, device=self.device).copy_(flat)

    @property
    def filling(self) -> bool:
        """The cycle holds a full-size gradient: a buffer, or autograd's gradients kept ([Note: a bucket that keeps
        autograd's gradients])."""
        return self.grad is not None or bool(self._held)

    def full_size_bytes(self) -> int:
        """The bytes of this cycle's full-size gradient (buffer or kept gradients), for the reducer's peak."""
        tensors = [self.grad] if self.grad is not None else list((self._held or {}).values())
        return sum(t.numel() * t.element_size() for t in tensors)

    # [Note: a single-tensor bucket reduces autograd's gradient itself]
    # A bucket that is one whole parameter with no padding (a stage-3 unit of its own: the input embeddings, an
    # untied LM head, the largest tensors of a model) would copy autograd's fresh gradient into a full-size buffer
    # of the same size and drop the original: two full-size gradients at once, at the very start of backward for the
    # LM head. The reducer took the only reference (`param.grad = None`), so the bucket reduces that tensor instead,
    # as FSDP2 reduces a parameter's own gradient. Only for the first gradient of a cycle into a bucket whose full
    # gradient lives only while it fills and reduces (stages 2/3; stages 0/1 keep a persistent buffer), of the
    # gradient dtype and contiguous; a later one is added to it as usual.
    def _adopts(self, slot: ParamSlot, grad: torch.Tensor) -> bool:
        return (
            self.grad is None
            and not self._held
            and self.mode is ReduceMode.SCATTER_TO_SHARD
            and len(self.plan.slots) == 1
            and slot.numel == self.plan.numel
            and grad.dtype == self.grad_dtype
            and grad.device == self.device
            and grad.is_contiguous()
        )

    def _full_grad(self, written: bool = True) -> torch.Tensor:
        """The full-size gradient; `written`: every slot holds its value (unwritten ones are zeroed first)."""
        if self.grad is None:
            if self._slot is not None:
                self.grad = self._slot.arena.take(self._slot.offset, self.plan.numel)
            else:
                self.grad = self.scratch.take(self.plan.numel, self.grad_dtype)
            self.grad[self.plan.numel - self.plan.padding :].zero_()  # a reused buffer holds another bucket's data
            self._unwritten = {slot.param_index for slot in self.plan.slots}
            held, self._held = self._held or {}, None
            for slot in self.plan.slots:  # kept gradients, when the reduction turns out not to read pieces
                if slot.param_index in held:
                    self.grad[slot.offset : slot.offset + slot.numel].copy_(held[slot.param_index])
                    self._unwritten.discard(slot.param_index)
        if written and self._unwritten is not None:
            for slot in self.plan.slots:
                if slot.param_index in self._unwritten:
                    self.grad[slot.offset : slot.offset + slot.numel].zero_()
            self._unwritten = None
        return self.grad

    def _owned(self, tensor: torch.Tensor) -> torch.Tensor:
        lo, hi = self.plan.shard_range(self.rank)
        return tensor[lo:hi]

    def _reopen(self) -> None:
        if self.mode is ReduceMode.SCATTER_IN_PLACE:
            assert self.grad is not None and self._scaling is not None
            owned = self._owned(self.grad).clone()
            self.grad.zero_()
            # pre * post == 1/W: scaling the owned slice by W makes the next average return it unchanged.
            self._owned(self.grad).copy_(owned / (self._scaling.pre * self._scaling.post))
        self.state = BucketState.ACCUMULATING

    # -------------------------------------------------------------------- reduction
    def start_reduce(
        self,
        dp: DataParallelGroup,
        stats: CommStats,
        scaling: GradScaling,
        use_reduce_scatter: bool,
        async_op: bool,
        replicate: DataParallelGroup | None = None,
        quantized: QuantizedReduceScatter | None = None,
        pieces: bool = False,
    ) -> None:
        """Issues this bucket's collective; an EMPTY bucket takes part with zeros (other ranks may have data).
        `replicate`: the ranks holding the same shard ([Note: reducing over replicas]). `quantized`: qgZ, the
        shard's reduce-scatter in int4 blocks (engine/quantized_comm.py; synchronous). `pieces`: reduce-scatter
        the gradient as pieces ([Note: a bucket that keeps autograd's gradients]); every rank decides it alike."""
        if self._pending is not None:
            raise RuntimeError(f"bucket {self.plan.index} already has a reduction in flight")
        if self.state not in (BucketState.EMPTY, BucketState.ACCUMULATING):
            raise RuntimeError(f"bucket {self.plan.index} cannot start a reduction in state {self.state}")
        self._scaling = scaling
        self._replicate, self._stats = replicate, stats
        assert replicate is None or self.mode is ReduceMode.SCATTER_TO_SHARD, "replicas exist at stage 3 only"
        self.state = BucketState.REDUCING
        if pieces:
            assert self.mode is ReduceMode.SCATTER_TO_SHARD and quantized is None and use_reduce_scatter
            assert scaling.pre == 1.0 and self.comm_dtype == self.grad_dtype, "pieces are reduced as they are"
            self._comm_pieces = self._pieces()
            self._pending = collectives.reduce_scatter_pieces(
                self._comm_pieces, dp, stats, async_op=async_op, scratch=self.scratch
            )
            return
        full = self._full_grad()
        comm = full if self.comm_dtype == full.dtype else self.scratch.take(full.numel(), self.comm_dtype).copy_(full)
        if scaling.pre != 1.0:
            comm.mul_(scaling.pre)
        if quantized is not None and self.mode is ReduceMode.SCATTER_TO_SHARD:
            quantized(self._owned(comm), comm, stats)
            self._pending = Pending(None)
        elif self.mode is ReduceMode.ALL_REDUCE or not use_reduce_scatter:
            self._pending = collectives.all_reduce(comm, dp, stats, async_op=async_op)
        else:
            self._pending = collectives.reduce_scatter(
                self._owned(comm), comm, dp, stats, async_op=async_op, scratch=self.scratch
            )
        self._comm_buffer = comm

    def _pieces(self) -> list[torch.Tensor]:
        """The gradient as one piece per slot and one for the padding, in the plan's order: the places where every
        rank cuts the reduce-scatter's messages ([Note: a reduce-scatter of pieces] in engine/collectives.py)."""
        slots, numel = sorted(self.plan.slots, key=lambda slot: slot.offset), self.plan.numel
        if self.grad is not None or not self._held:  # a buffer (or nothing: zeros) of its own
            full = self._full_grad()
            pieces = [full[slot.offset : slot.offset + slot.numel] for slot in slots]
            return pieces + ([full[numel - self.plan.padding :]] if self.plan.padding else [])
        held, zeros = self._held, lambda n: torch.zeros(n, dtype=self.grad_dtype, device=self.device)
        pieces = [held[slot.param_index] if slot.param_index in held else zeros(slot.numel) for slot in slots]
        return pieces + ([zeros(self.plan.padding)] if self.plan.padding else [])

    def _owned_of_pieces(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """This rank's chunk of the reduced pieces: a view when one piece holds it, else a copy from `scratch`
        (then True)."""
        lo, hi = self.plan.shard_range(self.rank)
        views, position = [], 0
        for piece in pieces:
            start, end = max(lo, position), min(hi, position + piece.numel())
            if start < end:
                views.append(piece[start - position : end - position])
            position += piece.numel()
        if len(views) == 1:
            return views[0], False
        return torch.cat(views, out=self.scratch.take(hi - lo, self.grad_dtype)), True

    def finish_reduce(self) -> None:
        """Waits for the collective and stores its result; does nothing when no reduction is in flight."""
        if self.state is not BucketState.REDUCING:
            return
        assert self._pending is not None and self._scaling is not None
        self._pending.wait()
        if self._comm_pieces is not None:
            self._finish_pieces(self._comm_pieces, self._scaling.post)
            return
        assert self._comm_buffer is not None
        comm, post, self._pending, self._comm_buffer = self._comm_buffer, self._scaling.post, None, None
        if self.mode is ReduceMode.ALL_REDUCE:
            self._store_all_reduced(comm, post)
            self._keep_reduced_in_place()
        elif self.mode is ReduceMode.SCATTER_IN_PLACE:
            self._store_scattered_in_place(comm, post)
            self._keep_reduced_in_place()
        else:
            if self._replicate is not None:
                # [Note: reducing over replicas]
                collectives.all_reduce(self._owned(comm), self._replicate, self._stats, kind="all_reduce_replicas")
            self.kept.add(self._owned(comm), post, fresh=not self._has_reduced)
            self._has_reduced = True
            self._give_back(comm)
            self.state = BucketState.EMPTY
            return
        self._give_cast_copy(comm)
        self.state = BucketState.REDUCED

    def _finish_pieces(self, pieces: list[torch.Tensor], post: float) -> None:
        self._pending, self._comm_pieces = None, None
        owned, copied = self._owned_of_pieces(pieces)
        if self._replicate is not None:
            # [Note: reducing over replicas]
            collectives.all_reduce(owned, self._replicate, self._stats, kind="all_reduce_replicas")
        self.kept.add(owned, post, fresh=not self._has_reduced)
        self._has_reduced = True
        self.kept.settle()  # `owned` may be autograd's gradient, dropped below (a copy from it may be in flight)
        self._give_back(owned if copied else None)
        self.state = BucketState.EMPTY

    def _give_back(self, comm: torch.Tensor | None) -> None:
        """Gives the full-size gradient (lazily allocated) and a cast copy `comm` back to `scratch`."""
        if self.scratch.reuses:
            # `kept` may still be copying from them (KeptGradient.add); a reused buffer is written next.
            self.kept.settle()
        if comm is not None:
            self._give_cast_copy(comm)
        if self.grad is not None and self._slot is not None:
            self._slot.arena.give()
        elif self.grad is not None and not self._adopted:
            self.scratch.give(self.grad)  # (autograd's own gradient is dropped: no later one is served from it)
        self.grad, self._adopted, self._held = None, False, None

    def _give_cast_copy(self, comm: torch.Tensor) -> None:
        """Gives back the buffer a reduction ran on when it is a cast copy, not the gradient itself."""
        if comm is not self.grad:
            self.scratch.give(comm)

    def _store_all_reduced(self, comm: torch.Tensor, post: float) -> None:
        assert self.grad is not None
        if comm is not self.grad:
            self.grad.copy_(comm)
        if post != 1.0:
            self.grad.mul_(post)

    def _store_scattered_in_place(self, comm: torch.Tensor, post: float) -> None:
        assert self.grad is not None
        owned = self._owned(self.grad)
        if comm is not self.grad:
            owned.copy_(self._owned(comm))
        if post != 1.0:
            owned.mul_(post)

    def _keep_reduced_in_place(self) -> None:
        """Stages 0/1: the averaged values are in the full buffer; `kept` takes them (a view, or under optimizer
        offload one copy to host memory, started now: [Note: a gradient slice in host memory])."""
        full = self._full_grad()
        self.kept.add(full if self.mode is ReduceMode.ALL_REDUCE else self._owned(full), 1.0, fresh=True)
        self._has_reduced = True

    # ------------------------------------------------------------------ after step
    def reduced_slice(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of this rank's averaged gradient slice (the whole bucket at stage 0)."""
        self._ensure_kept()
        return self.kept.read(start, end)

    def reduced_shard(self) -> torch.Tensor:
        """This rank's averaged gradient slice (the whole bucket at stage 0), ready for the optimizer."""
        return self.reduced_slice(0, self.kept.numel)

    def square_norm(self, device: torch.device) -> torch.Tensor:
        """The sum of squares of `reduced_shard()` (fp64, 0-dim, on `device`), without reading a slice kept in a
        file."""
        self._ensure_kept()
        return self.kept.square_norm(device)

    def _ensure_kept(self) -> None:
        if self.state is BucketState.REDUCING:
            raise RuntimeError(f"bucket {self.plan.index}: finish_reduce() before reading the gradient")
        if self._has_reduced:
            return
        if self.mode is ReduceMode.SCATTER_TO_SHARD:
            self.kept.clear()  # nothing was reduced into it in this step
            self._has_reduced = True
        else:
            self._keep_reduced_in_place()  # what the buffer holds (not reduced in this step)

    def zero(self) -> None:
        """Clears the gradients after an optimizer step (or a skipped one); releases lazily allocated storage."""
        if self.state is BucketState.REDUCING:
            self.finish_reduce()
        self.kept.reset()  # a copy in flight may still read the gradient released below
        self._give_back(None)
        self._has_reduced = False
        self.state = BucketState.EMPTY

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradient storage kept across micro-steps (for memory accounting)."""
        full = [self.grad] if self.mode is not ReduceMode.SCATTER_TO_SHARD and self.grad is not None else []
        return full + ([] if self.kept.in_host else self.kept.tensors())

    def transient_tensors(self) -> list[torch.Tensor]:
        """Buffers that live only while the bucket fills and reduces (stage 2's full gradient, a cast copy)."""
        transient = []
        if self.mode is ReduceMode.SCATTER_TO_SHARD and self.grad is not None:
            transient.append(self.grad)
        transient += list((self._held or {}).values())
        if self._comm_buffer is not None and self._comm_buffer is not self.grad:
            transient.append(self._comm_buffer)
        return transient
