"""OwnedTensors: the parameters whose optimizer reads them whole, each stepped in its own shape on its owner rank.

The plan says who owns what and which pieces move ([Note: owners over the flat layout] in engine/owner_plan.py).
Per optimizer step, after the flat layout reduced the gradients into each rank's shard and the global norm was
taken from those shards (exact: every element is in one shard), this object:
1. brings each owned parameter's averaged gradient to its owner: the pieces in other ranks' shards in one
   all-to-all (`owner_gradients`), the pieces in its own shard by a copy;
2. multiplies it by the step's coefficient (unscale and clip, as the flat step does) and steps the user's
   optimizer over the owner's fp32 masters, each in the parameter's shape;
3. sends each holder its piece of the updated values in the compute dtype (`owner_values`), written into its
   shard; the stage then publishes the shards as usual (stages 1-2: the all-gather; stage 3: units gather on use).
The masters and their optimizer state exist on the owner only (under optimizer offload in host memory). What stays
on the flat layout (this rank's slices of the same buckets) are the parameter shards and the gradient shards: the
step reads and writes them, nothing else does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.buckets import GradBucket
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.owner_plan import OwnedParam, OwnerPlan, Piece
from accelerate_zero.engine.shard_slice import ShardSlice


GRADIENTS_KIND, VALUES_KIND = "owner_gradients", "owner_values"
"""`CommStats` kinds of the two exchanges (`engine.comm_stats()`; bench/owner_step.py counts them)."""


@dataclass(frozen=True)
class OwnedMaster:
    """One parameter this rank owns: its plan entry, its bucket and its fp32 master in the parameter's shape (the
    tensor the optimizer steps and keys its state by)."""

    param: OwnedParam
    bucket: GradBucket
    master: torch.Tensor


class OwnedTensors:
    """Steps the whole-tensor param groups on their owners (see the module docstring)."""

    def __init__(
        self,
        plan: OwnerPlan,
        buckets: list[GradBucket],
        held: list[ShardSlice],
        dp: DataParallelGroup,
        stats: CommStats,
        *,
        device: torch.device,
        grad_dtype: torch.dtype,
        value_dtype: torch.dtype,
        make_master: Callable[[tuple[int, ...]], torch.Tensor],
    ) -> None:
        """
        Args:
            plan: owners and pieces, planned over `buckets` (the reducer's buckets, in its order).
            held: this rank's runs of the whole-tensor groups' shards (where their pieces' values are stored).
            dp: the shard group the buckets are cut over (at stage 0 nothing is exchanged).
            device: where the exchange buffers live (the compute device: NCCL moves device memory only).
            grad_dtype: the dtype of the reduced gradient shards (what the gradients travel in).
            value_dtype: the dtype of the parameter shards (the compute dtype: what the values travel in).
            make_master: a zeroed fp32 tensor of a shape, where masters live (device, or host under offload).
        """
        self.plan, self.buckets, self.dp, self.stats, self.device = plan, buckets, dp, stats, device
        self.grad_dtype, self.value_dtype = grad_dtype, value_dtype
        ranks = {b.rank for i, b in enumerate(buckets) if any(p.bucket == i for p in plan.params)}
        assert len(ranks) <= 1, f"buckets of one engine are cut for one rank, got {ranks}"
        self.rank = ranks.pop() if ranks else 0
        """This rank's index among the plan's shards (0 at stage 0: every rank holds and owns everything)."""
        self._runs: dict[int, list[ShardSlice]] = {}
        for shard_slice in held:
            self._runs.setdefault(id(shard_slice.bucket), []).append(shard_slice)
        self.mine = [
            OwnedMaster(param, buckets[param.bucket], make_master(param.shape)) for param in plan.owned_by(self.rank)
        ]
        self._moves = plan.moves() if plan.moves_anything() else None
        self.refresh_masters()

    # ------------------------------------------------------------------ groups
    def masters_of_group(self, group: int) -> list[torch.Tensor]:
        """The masters this rank steps in optimizer param group `group` (its `params` after the switch)."""
        return [owned.master for owned in self.mine if owned.param.group == group]

    def masters(self) -> list[torch.Tensor]:
        return [owned.master for owned in self.mine]

    def master_of_params(self) -> dict[int, torch.Tensor]:
        """id(model parameter) -> the master this rank steps for it."""
        return {id(each.bucket.params[each.param.slot.param_index]): each.master for each in self.mine}

    def stepped_buckets(self) -> list[GradBucket]:
        """The buckets holding a parameter stepped whole (their shards count in the global gradient norm)."""
        return list({param.bucket: self.buckets[param.bucket] for param in self.plan.params}.values())

    # -------------------------------------------------------------------- step
    def step(self, optimizer: torch.optim.Optimizer, coefficient: float) -> None:
        """Brings the gradients to their owners, steps `optimizer` over the owned masters (the flat masters have no
        gradient then, so torch's optimizers leave them), and sends the updated values back."""
        grads = self._to_owners(self._read_gradient, self.grad_dtype, GRADIENTS_KIND)
        for owned in self.mine:
            master = owned.master
            grad = grads[owned.param.index].to(device=master.device, dtype=master.dtype).view(master.shape)
            if coefficient != 1.0:
                grad.mul_(coefficient)  # (in place in the reduced shard, as the flat step does)
            master.grad = grad
        del grads
        optimizer.step()
        for owned in self.mine:
            owned.master.grad = None
        self.write_values()

    def write_values(self) -> None:
        """Every holder's pieces of the owned parameters, from the owners' masters (after a step or a load)."""
        values = {owned.param.index: owned.master.detach().reshape(-1) for owned in self.mine}
        self._from_owners(values)

    def refresh_masters(self) -> None:
        """Every owner's masters, from the holders' parameter values (after the parameters were overwritten)."""
        values = self._to_owners(self._run_values, self.value_dtype, VALUES_KIND)
        for owned in self.mine:
            owned.master.copy_(values[owned.param.index].view(owned.master.shape))

    # ---------------------------------------------------------------- exchange
    def _read_gradient(self, param: OwnedParam, piece: Piece) -> torch.Tensor:
        return self.buckets[param.bucket].reduced_slice(piece.at, piece.at + piece.numel)

    def _run_values(self, param: OwnedParam, piece: Piece) -> torch.Tensor:
        """This rank's stored parameter values of `piece` (a view of its shard)."""
        for run in self._runs.get(id(self.buckets[param.bucket]), []):
            if run.start <= piece.at and piece.at + piece.numel <= run.end:
                return run.params[piece.at - run.start : piece.at - run.start + piece.numel]
        raise AssertionError(f"no run of this rank's shard holds {piece} of parameter {param.index}")

    def _to_owners(
        self, read: Callable[[OwnedParam, Piece], torch.Tensor], dtype: torch.dtype, kind: str
    ) -> dict[int, torch.Tensor]:
        """Each owned parameter of this rank whole (1-D `dtype`), from every holder's `read` of its pieces: a view of
        `read`'s tensor for a parameter wholly in this rank's shard, else a new tensor on the exchange device."""
        out: dict[int, torch.Tensor] = {}
        for owned in self.mine:
            param = owned.param
            if len(param.pieces) == 1 and param.pieces[0].holder == self.rank:
                out[param.index] = read(param, param.pieces[0])  # in this rank's shard: a view, no copy
                continue
            whole = torch.empty(param.numel, dtype=dtype, device=self.device)
            for piece in param.pieces:
                if piece.holder == self.rank:
                    whole[piece.lo : piece.hi].copy_(read(param, piece))
            out[param.index] = whole
        if self._moves is None:
            return out
        send_pairs = [self._moves.get((self.rank, dst), []) for dst in range(self.plan.num_shards)]
        pieces = [read(param, piece).to(dtype) for pairs in send_pairs for param, piece in pairs]
        received = self._exchange(self._pack(pieces, dtype), send_pairs, kind)
        offset = 0
        for src in range(self.plan.num_shards):
            for param, piece in self._moves.get((src, self.rank), []):
                out[param.index][piece.lo : piece.hi].copy_(received[offset : offset + piece.numel])
                offset += piece.numel
        return out

    def _from_owners(self, values: dict[int, torch.Tensor]) -> None:
        """Writes each holder's pieces of the owned parameters from the owners' `values` (1-D), cast to the shard's
        dtype."""
        for owned in self.mine:
            flat = values[owned.param.index]
            for piece in owned.param.pieces:
                if piece.holder == self.rank:
                    self._run_values(owned.param, piece).copy_(flat[piece.lo : piece.hi])
        if self._moves is None:
            return
        send_pairs = [self._moves.get((dst, self.rank), []) for dst in range(self.plan.num_shards)]
        dtype = self.value_dtype
        pieces = [values[param.index][piece.lo : piece.hi].to(dtype) for pairs in send_pairs for param, piece in pairs]
        send = self._pack(pieces, dtype)
        receive_pairs = [self._moves.get((self.rank, src), []) for src in range(self.plan.num_shards)]
        received = self._exchange(send, send_pairs, VALUES_KIND, receive_pairs)
        offset = 0
        for pairs in receive_pairs:
            for param, piece in pairs:
                self._run_values(param, piece).copy_(received[offset : offset + piece.numel])
                offset += piece.numel

    def _exchange(
        self,
        send: torch.Tensor,
        send_pairs: list[list[tuple[OwnedParam, Piece]]],
        kind: str,
        receive_pairs: list[list[tuple[OwnedParam, Piece]]] | None = None,
    ) -> torch.Tensor:
        assert self._moves is not None
        if receive_pairs is None:
            receive_pairs = [self._moves.get((src, self.rank), []) for src in range(self.plan.num_shards)]
        send_counts = [sum(piece.numel for _, piece in pairs) for pairs in send_pairs]
        receive_counts = [sum(piece.numel for _, piece in pairs) for pairs in receive_pairs]
        return collectives.all_to_all_uneven(send, send_counts, receive_counts, self.dp, self.stats, kind=kind)

    def _pack(self, pieces: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One send buffer on the exchange device (empty when this rank sends nothing)."""
        if pieces:
            return torch.cat([piece.to(self.device) for piece in pieces])
        return torch.empty(0, dtype=dtype, device=self.device)
