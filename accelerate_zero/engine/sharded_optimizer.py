"""ShardedOptimizer: the user's torch optimizer stepping this rank's fp32 shard slices.

The user's optimizer object is kept and its param groups are switched in place to the master shards (as
accelerate does for FSDP2), so its class, hyperparameters, groups, and any LR scheduler bound to it keep working.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.loss_scaler import LossScaler
from accelerate_zero.engine.owned_step import OwnedTensors
from accelerate_zero.engine.progress import raise_if_out_of_step, slots_with
from accelerate_zero.engine.setup import constructor_state, has_constructor_state_only
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.step_in_flight import StepInFlight, overlap_enabled
from accelerate_zero.engine.stores import ShardsInMemory, ShardStore, StepRunner, StepsInMemory
from accelerate_zero.optim.bitsandbytes import carry_overrides


OPTIMIZER_STEP = "ZeRO::optimizer_step"
"""Profiler range around the optimizer step (under offload: the host step lane of bench/gpu_compare_worker.py)."""


@dataclass(frozen=True)
class StepOutcome:
    grad_norm: float
    """Global L2 norm of the unscaled gradient, before clipping (inf/nan on overflow)."""
    overflow: bool
    """True when the step was skipped because a gradient was not finite."""


class ShardedOptimizer:
    """Steps this rank's shard slices, then lets the stage publish the updated parameters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        slices_by_group: list[list[ShardSlice]],
        dp: DataParallelGroup,
        stats: CommStats,
        *,
        sharded: bool,
        gradient_clipping: float,
        loss_scaler: LossScaler | None,
        check_overflow: bool,
        publish: Callable[[], None],
        device: torch.device,
        progress: Callable[[], int] | None = None,
        copies: HostCopies | None = None,
        step_runner: StepRunner | None = None,
        shard_store: ShardStore | None = None,
        host_threads: AbstractContextManager | None = None,
        owned: OwnedTensors | None = None,
    ) -> None:
        """
        Args:
            slices_by_group: for each param group of `optimizer`, the shard slices it steps.
            sharded: gradients are partitioned over ranks (stages 1-3): the norm needs an all-reduce.
            publish: called after the step to make the updated shards visible as parameters (stages 1 and 2:
                the all-gather; stage 3: nothing, units gather on use).
            progress: this rank's micro-step counter, compared across ranks at every step ([Note: ranks out of
                step]); None: not checked.
            copies: how masters in host memory reach device parameters (engine/host_copies.py).
            step_runner: how the step reaches masters and state ([Note: offload is a store, not a flag] in
                engine/stores.py); default: all in memory.
            shard_store: where stage-3 shards live; slices it `holds` are read and written through it.
            host_threads: entered around the step (offload/host_threads.py: the rank's cores for host work).
            owned: the param groups stepped as whole tensors on their owners (engine/owned_step.py; their lists in
                `slices_by_group` are empty); None: every group steps flat shards.
        """
        self.optimizer, self.slices_by_group, self.dp, self.stats = optimizer, slices_by_group, dp, stats
        self.sharded, self.gradient_clipping = sharded, gradient_clipping
        self.loss_scaler, self.check_overflow, self.publish = loss_scaler, check_overflow, publish
        self.device, self.progress = device, progress
        self.copies = copies if copies is not None else HostCopies(device)
        """Where the norm is all-reduced (gradients may live in host memory under offload)."""
        self.slices = [s for group in slices_by_group for s in group]
        self.step_runner = step_runner if step_runner is not None else StepsInMemory(self.slices)
        self.shard_store = shard_store if shard_store is not None else ShardsInMemory()
        held = [*(s.bucket for s in self.slices), *(owned.stepped_buckets() if owned is not None else [])]
        self.buckets = list({id(bucket): bucket for bucket in held}.values())
        """Every bucket with a gradient this optimizer steps: the global norm sums their shards."""
        self.host_threads = host_threads if host_threads is not None else contextlib.nullcontext()
        # The worker enters a context of its own: HostThreads remembers what to restore, per entry.
        self._worker_threads = copy.copy(host_threads)
        self.in_flight: StepInFlight | None = None
        """The host step on its worker thread, once the first step ran across the boundary."""
        self.owned = owned

    def switch_param_groups(self) -> None:
        """Points the optimizer's param groups at the master slices."""
        # Some optimizers (Adagrad) make state in their constructor: that state is made again for the shards.
        remake = bool(self.optimizer.state) and has_constructor_state_only(self.optimizer)
        if self.optimizer.state and not remake:
            raise ValueError(
                "the optimizer already has state (was it stepped before accelerate_zero.initialize?): pass a fresh "
                "optimizer; its state would belong to the unsharded parameters"
            )
        self.optimizer.state.clear()
        originals = [list(group["params"]) for group in self.optimizer.param_groups]
        groups = zip(self.optimizer.param_groups, self.slices_by_group, strict=True)
        for index, (param_group, slices) in enumerate(groups):
            owned = self.owned.masters_of_group(index) if self.owned is not None else []
            param_group["params"] = [s.master for s in slices] + owned
        if remake:
            self.optimizer.state.update(constructor_state(self.optimizer))
        if self.owned is not None:
            carry_overrides(self.optimizer, originals, self.owned.master_of_params())

    # -------------------------------------------------------------------- step
    def step(self, then: Callable[[], None] | None = None, gated: list[torch.Tensor] | None = None) -> StepOutcome:
        """Clips, unscales and steps the shard, copies it into the 16-bit parameters and publishes them; then calls
        `then` (the engine zeroes the gradients).

        `gated`: the parameter shards every later read of which goes through `shard_store` (stage 3's unit shards):
        an offloaded host step of their slices may run on a worker thread after this returns ([Note: the host step
        across the step boundary] in engine/step_in_flight.py), `then` running when it is settled."""
        self.settle()
        with record_function(OPTIMIZER_STEP), self.host_threads:
            outcome, coefficient = self._decide()
            if coefficient is None:  # skipped: nothing to step
                if then is not None:
                    then()
                return outcome
            if self.owned is not None:  # whole tensors first, synchronously: their values are in the shards after
                self.owned.step(self.optimizer, coefficient)
            flight = self._flight_for(gated or [])
            if flight is not None:
                flight.step_direct(self, coefficient)  # what is read without the gate: published now
                self.publish()  # stage 3: also drops gathered copies; the next gathers wait for their slices
                flight.launch(self, coefficient, [then] if then is not None else [])
                return outcome
            if self.slices:
                self.step_runner.step(self, coefficient)
            self.shard_store.flush()
            self.publish()
        if then is not None:
            then()
        return outcome

    def _decide(self) -> tuple[StepOutcome, float | None]:
        """The norm, the overflow and the coefficient the gradients are multiplied by (None: the step is skipped)."""
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # Masters and offloaded shards are written below: no copy may still be reading them (engine/host_copies.py).
        self.copies.drain()
        norm = self._global_norm() / scale
        overflow = self.check_overflow and not math.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if overflow:
            return StepOutcome(grad_norm=norm, overflow=True), None
        coefficient = 1.0 / scale
        if self.gradient_clipping > 0:
            # Same coefficient as torch.nn.utils.clip_grad_norm_, folded into the unscale multiply.
            coefficient *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        return StepOutcome(grad_norm=norm, overflow=False), coefficient

    def _flight_for(self, gated: list[torch.Tensor]) -> StepInFlight | None:
        """The worker that steps across the boundary, made on first use; None where the step stays synchronous."""
        if not (gated and self.step_runner.on_host and self.shard_store.gates_reads and overlap_enabled(self.device)):
            return None
        if self.in_flight is None:
            self.in_flight = StepInFlight(
                self.step_runner, self.slices, self.device, self._worker_threads, OPTIMIZER_STEP
            )
            self.shard_store.gate_reads(self.in_flight.wait_for)
        return self.in_flight if self.in_flight.plan(gated) else None

    @property
    def stepping(self) -> bool:
        """A host step is running on its worker thread (until `settle`)."""
        return self.in_flight is not None and self.in_flight.running

    def settle(self) -> None:
        """Waits for a host step still running on its worker and runs what follows it ([Note: the host step across
        the step boundary] in engine/step_in_flight.py); nothing when none is."""
        if self.in_flight is not None:
            self.in_flight.settle()

    def step_slices(
        self,
        slices: list[ShardSlice],
        coefficient: float,
        grads: list[torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        copies: HostCopies | None = None,
    ) -> None:
        """Attaches the clipped gradients of `slices` (`grads` when already read), steps the optimizer, copies the
        masters into parameters. A worker thread passes its own view of the optimizer and its own `copies`."""
        self._attach_grads(slices, coefficient, grads)
        (optimizer if optimizer is not None else self.optimizer).step()
        for shard_slice in slices:
            shard_slice.master.grad = None
        self.write_params(slices, copies)

    def write_params(self, slices: list[ShardSlice], copies: HostCopies | None = None) -> None:
        """Copies the masters of `slices` into the parameter shards (into their files under NVMe offload)."""
        copies = copies if copies is not None else self.copies
        for shard_slice in slices:
            if self.shard_store.holds(shard_slice):
                self.shard_store.write_slice(shard_slice)
            elif not shard_slice.aliased:
                copies.into_device(shard_slice.master, shard_slice.params)

    def _global_norm(self) -> float:
        # [Note: the norm of a large flat buffer]: summed in fp64 from chunks, exact to fp32 rounding at any size (a
        # slice kept in a file gives the norm taken when it was written: offload/nvme_grads.py).
        sum_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for bucket in self.buckets:
            sum_sq += bucket.square_norm(self.device)
        if self.sharded:
            # Each element belongs to exactly one rank's shard: summing the squares over ranks gives the full norm.
            sum_sq = self._all_reduce_checking_progress(sum_sq, "all_reduce")
        elif self.progress is not None and self.dp.world_size > 1:
            self._all_reduce_checking_progress(torch.zeros((), device=self.device), "progress")
        return sum_sq.sqrt().item()

    def _all_reduce_checking_progress(self, sum_sq: torch.Tensor, kind: str) -> torch.Tensor:
        """All-reduces `sum_sq` with every rank's micro-step counter beside it ([Note: ranks out of step] in
        engine/progress.py): every rank fails at once, naming the counters, when they differ."""
        if self.progress is None:
            collectives.all_reduce(sum_sq, self.dp, self.stats, kind=kind)
            return sum_sq
        counters = slots_with(self.progress(), self.dp.rank, self.dp.world_size, self.device, sum_sq.dtype)
        payload = torch.cat([sum_sq.reshape(1), counters])
        collectives.all_reduce(payload, self.dp, self.stats, kind=kind)
        raise_if_out_of_step(payload[1:], self.dp.rank, "at the optimizer step")
        return payload[0]

    def _attach_grads(self, slices: list[ShardSlice], coefficient: float, grads: list[torch.Tensor] | None) -> None:
        if grads is None:
            grads = [s.bucket.reduced_slice(s.start, s.end) for s in slices]
        for shard_slice, grad in zip(slices, grads, strict=True):
            master = shard_slice.master
            if grad.dtype != master.dtype or grad.device != master.device:
                grad = grad.to(dtype=master.dtype, device=master.device)
            if coefficient != 1.0:
                grad.mul_(coefficient)
            master.grad = grad

    def refresh_masters(self) -> None:
        """Copies the parameter shards into the fp32 master weights (after parameters were overwritten)."""
        self.settle()
        self.copies.drain()
        if self.owned is not None:
            self.owned.refresh_masters()
        for slices in self.resident_slices(write_back=True):
            for shard_slice in slices:
                if self.shard_store.holds(shard_slice):
                    shard_slice.master.copy_(self.shard_store.read_slice(shard_slice))
                elif not shard_slice.aliased:
                    shard_slice.master.copy_(shard_slice.params)

    def resident_slices(self, write_back: bool) -> Iterator[list[ShardSlice]]:
        """Every slice, in batches whose masters and optimizer state are in memory while the batch is used (all
        at once, or one NVMe sub-group at a time: with `write_back` changes go back to its file)."""
        self.settle()
        yield from self.step_runner.each_resident(self.optimizer, write_back)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Master weights and optimizer state tensors (for memory accounting)."""
        self.settle()  # the worker adds state on a first step
        masters = [s.master for s in self.slices if not s.aliased]
        masters += self.owned.masters() if self.owned is not None else []
        states = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {"master_weights": masters, "optimizer_states": states}
