"""What checkpointing reads of an engine, typed once for every module of this package (engine/engine.py implements
it and calls this package: a Protocol here keeps the package from importing the engine back, and its modules from
importing each other for a type)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch


if TYPE_CHECKING:
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.engine.checkpoint_state import CheckpointState
    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.groups import DataParallelGroup
    from accelerate_zero.engine.layout import ShardingLayout


class ZeroEngine(Protocol):
    """What saving and loading use of an engine: its group and config, and the contract of
    engine/checkpoint_state.py (engine.py implements it, and calls this module: typed here so that this module does
    not import the engine back)."""

    config: ZeroConfig
    dp: DataParallelGroup
    """The ranks one copy of the state is partitioned over: one rank file each."""
    layout: ShardingLayout
    device: torch.device
    comm_stats_counter: CommStats
    stage: int
    lr_scheduler: Any

    def checkpoint_state(self) -> CheckpointState: ...

    def zero_grad(self) -> None: ...
