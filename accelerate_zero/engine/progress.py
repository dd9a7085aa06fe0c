"""Checks that every rank is at the same micro-step, riding on collectives the engine makes anyway.

[Note: ranks out of step]
A rank that skips a micro-step (it caught an exception and went on) pairs its collectives with the other ranks'
next ones: training goes on with mismatched gradients, then hangs until the process-group timeout (30 minutes by
default). So each rank writes its position, in its own slot, into a small all-reduce; every rank then sees every
rank's position and all of them fail at once, naming them. The optimizer step carries the micro-step counter in
its gradient-norm all-reduce (engine/sharded_optimizer.py). At stages 2 and 3 every backward reduces, so a skipped
backward breaks the pairing before any step: there, each backward also issues an asynchronous all-reduce of its
position (micro-step counter and whether it ends on the accumulation boundary) before autograd starts and waits
for it once backward is done, so it costs no waiting on the critical path. A position is written modulo 2**23 so
that it is exact in fp32 (the other slots add zeros).
"""

from __future__ import annotations

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats, Pending
from accelerate_zero.engine.groups import DataParallelGroup


_MODULO = 1 << 23


def slots_with(position: int, rank: int, world_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`world_size` zeros with this rank's `position` in its slot."""
    slots = torch.zeros(world_size, dtype=dtype, device=device)
    slots[rank] = position % _MODULO
    return slots


def raise_if_out_of_step(slots: torch.Tensor, rank: int, where: str, describe: str = "micro-step counters") -> None:
    """Raises when the all-reduced `slots` hold different positions ([Note: ranks out of step])."""
    positions = [int(value) for value in slots.tolist()]
    if len(set(positions)) > 1:
        raise RuntimeError(
            f"ranks are out of step {where}: {describe} by rank {positions} (this is rank {rank}, at "
            f"{positions[rank]}). A rank skipped or repeated a micro-step (e.g. it caught an exception and went on): "
            "every rank must run the same forward/backward/step calls; skip a bad batch on every rank, or let the "
            "exception end the job"
        )


class BackwardPositionCheck:
    """One backward's asynchronous position check (stages 2 and 3): `start()` before autograd, `finish()` after."""

    def __init__(self, dp: DataParallelGroup, stats: CommStats, device: torch.device) -> None:
        self.dp, self.stats, self.device = dp, stats, device
        self._slots: torch.Tensor | None = None
        self._pending: Pending | None = None

    def start(self, micro_step: int, boundary: bool) -> None:
        assert self._pending is None, "a position check is already in flight"
        self._slots = slots_with(
            2 * micro_step + int(boundary), self.dp.rank, self.dp.world_size, self.device, torch.float32
        )
        self._pending = collectives.all_reduce(self._slots, self.dp, self.stats, async_op=True, kind="progress")

    def finish(self) -> None:
        """Waits for the check (the slots live until then) and raises when the ranks are out of step."""
        if self._pending is None:
            return
        pending, slots, self._pending, self._slots = self._pending, self._slots, None, None
        pending.wait()
        assert slots is not None
        raise_if_out_of_step(
            slots, self.dp.rank, "at backward", "positions (2 x micro-step counter + 1 on the accumulation boundary)"
        )
