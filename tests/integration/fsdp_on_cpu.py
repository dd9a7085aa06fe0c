"""accelerate's FSDP on the CPU, for the tests that compare with it: accelerate keeps its `fsdp_plugin` (and the
FSDP distributed type) only on accelerators, and every `AcceleratorState()` copies `PartialState`'s distributed
type back over it, so both are forced here. Test harness only: the product never does this."""

from __future__ import annotations

from typing import Any


def force_fsdp(plugin: Any) -> None:
    """Makes accelerate's process state say FSDP with `plugin` (call after building the Accelerator)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    PartialState().distributed_type = DistributedType.FSDP
    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin


def fsdp_trainer_class() -> type:
    """transformers' Trainer with FSDP forced on the CPU (its plugin built from the arguments, as it does)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Trainer

    class FsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            force_fsdp(FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    return FsdpTrainer
