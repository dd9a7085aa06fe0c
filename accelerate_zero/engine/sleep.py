"""Training state put to sleep and woken: `ZeroEngine.offload_states()` / `reload_states()`, DeepSpeed's API.

[Note: sleeping moves storages, not tensors]
Reinforcement-learning recipes share the GPUs between training and a generation engine: between rollouts the
trainer's state must leave the device and come back unchanged. The state is full of aliases (a parameter is a view
of a flat buffer, an fp32 master a view of the same shard, a gradient a slot of an arena, the optimizer's state
keyed by tensors it holds), and every alias must still point at the same values after waking. So what moves is the
storage under the tensors, never the tensors: each distinct storage of the chosen kinds is copied into host memory
and resized to 0 bytes (its device memory goes back to the allocator, every view keeps its shape and stride), and
waking resizes it back and copies the bytes in. No tensor object changes, so the optimizer, the hooks and the
user's references stay valid, and training resumes bit-identical to a run that never slept.

A storage shared by two kinds (fp32 training: the master is a view of the parameter shard) moves only when both
are asked for, so the kinds kept stay usable (GRPO generating with everything but the parameters asleep). Host memory the offload policy already holds (`offload_param`, `offload_optimizer`) is not
device memory and stays where it is. While asleep, a backward or step raises, naming `reload_states()`, and so
does a forward when the parameters were moved.

[Note: every entry point while asleep]
A tensor whose storage was resized to 0 bytes still has its shape: reading it on the CPU reads freed memory (a
segfault), on a GPU an illegal address. So nothing may read a moved kind until `reload_states()`, and each entry
point says what it needs (`SleepingState.check_awake`): the forward of the model or of any of its sub-modules and
`module.state_dict()` (hooks on every module while the parameters sleep), the full weights and the weight stream
(the parameters), `zero_grad` (the gradients), backward, step, saving and loading a checkpoint (everything). Each
refuses with the kinds asleep and the call that wakes them. What the caller asks for is what DeepSpeed does:
`offload_states` again adds kinds, `reload_states()` with nothing asleep does nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.debug.memory import EngineState, device_tensors


class OffloadStateTypeEnum(str, enum.Enum):
    """What `offload_states(include=...)` moves; DeepSpeed's names and values (deepspeed.runtime.zero.offload_states)."""

    optim_states = "optim_states"
    """The optimizer's state (Adam's moments, ...)."""
    hp_params = "hp_params"
    """The fp32 master weights."""
    lp_params = "lp_params"
    """The parameters in the compute dtype (stage 3: this rank's shards and the persistent parameters)."""
    lp_grads = "lp_grads"
    """The gradients held (stages 0/1: the full buffers; stages 2/3: the shard, held only from backward to step)."""
    contiguous_grad_buffer = "contiguous_grad_buffer"
    """The contiguous gradient storage (`contiguous_gradients`); here the same storage as `lp_grads`, so naming
    either moves it."""


GRADIENT_KINDS = frozenset({OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer})
"""DeepSpeed moves its gradient partitions and its contiguous buffer apart; here they are one storage, moved when
either is named (naming one must not move nothing)."""

HOST_KIND = {
    OffloadStateTypeEnum.lp_params: "host_parameters",
    OffloadStateTypeEnum.hp_params: "host_master_weights",
    OffloadStateTypeEnum.optim_states: "host_optimizer_states",
    OffloadStateTypeEnum.lp_grads: "host_gradients",
    OffloadStateTypeEnum.contiguous_grad_buffer: "host_gradients",
}
"""The `memory_breakdown` kind a sleeping storage's host copy is counted under (its first holder, in this order)."""


class OffloadDeviceEnum(str, enum.Enum):
    """Where `offload_states(device=...)` moves the state; DeepSpeed's values (only "cpu" is offered, as there)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def training_state(engine: EngineState) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """The engine's tensors of each kind on its device, as `memory_breakdown` counts them (`device_tensors`)."""
    device = device_tensors(engine)
    # every master, the views of the parameter shards (fp32 training) too: those move only with lp_params
    owned = engine.sharded_optimizer.owned  # whole parameters' masters (engine/owned_step.py)
    masters = [s.master for s in engine.sharded_optimizer.slices] + (owned.masters() if owned is not None else [])
    masters = [] if engine.offload.optimizer else masters
    return {
        OffloadStateTypeEnum.lp_params: device["parameters"],
        OffloadStateTypeEnum.hp_params: masters,
        OffloadStateTypeEnum.optim_states: device["optimizer_states"],
        OffloadStateTypeEnum.lp_grads: device["gradients"],
        OffloadStateTypeEnum.contiguous_grad_buffer: device["gradients"],
    }


def parse_include(include: Iterable[object] | None) -> set[OffloadStateTypeEnum]:
    """`include` as enum members: members of this enum (or DeepSpeed's, by value) or their string values."""
    if include is None:
        return set(OffloadStateTypeEnum)
    out = _parse_names(include)
    return out | GRADIENT_KINDS if out & GRADIENT_KINDS else out


def _parse_names(include: Iterable[object]) -> set[OffloadStateTypeEnum]:
    if isinstance(include, (str, enum.Enum)):
        include = [include]
    out = set()
    for item in include:
        value = getattr(item, "value", item)
        try:
            out.add(OffloadStateTypeEnum(value))
        except ValueError:
            names = ", ".join(kind.value for kind in OffloadStateTypeEnum)
            raise ValueError(f"offload_states(include=...): unknown state {item!r}; known: {names}") from None
    return out


def check_device(device: object) -> None:
    value = getattr(device, "value", device)
    if value != OffloadDeviceEnum.cpu.value:
        raise ValueError(
            f"offload_states(device={device!r}): only 'cpu' is supported (as in DeepSpeed); NVMe offload of training "
            "state is a config choice (zero_optimization.offload_optimizer / offload_param), not a sleep"
        )


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    host: torch.Tensor  # uint8, the storage's bytes
    kinds: frozenset[OffloadStateTypeEnum]  # every kind that holds the storage


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (whatever the dtypes of the tensors that use it)."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (storage.nbytes(),))


class SleepingState:
    """The storages `offload_states()` moved to host memory, until `reload_states()` puts them back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._moved: list[_Moved] = []
        self._asked: set[OffloadStateTypeEnum] = set()  # every kind named since the last reload
        self._guards: list[RemovableHandle] = []

    @property
    def asleep(self) -> bool:
        return bool(self._moved)

    def asleep_kinds(self) -> set[OffloadStateTypeEnum]:
        """The kinds that cannot be read now: every holder of a moved storage."""
        return {kind for moved in self._moved for kind in moved.kinds}

    def offload(
        self,
        kinds: Mapping[OffloadStateTypeEnum, Iterable[torch.Tensor]],
        include: set[OffloadStateTypeEnum],
        module: nn.Module,
        pin_memory: bool,
        non_blocking: bool,
    ) -> int:
        """Moves the storages of the `include`d kinds off the device (those already moved stay moved: a second call
        adds kinds, as DeepSpeed's does: a storage held by kinds named over several calls moves once all are named);
        returns the bytes moved by this call."""
        self._asked |= include
        include = self._asked
        holders: dict[int, set[OffloadStateTypeEnum]] = {}  # storage -> the kinds that hold it
        storages: dict[int, torch.UntypedStorage] = {}
        for kind, tensors in kinds.items():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if tensor.device == self.device and storage.nbytes() > 0:
                    holders.setdefault(storage.data_ptr(), set()).add(kind)
                    storages[storage.data_ptr()] = storage
        pin = pin_memory and self.device.type == "cuda"
        moved_bytes = 0
        for key, storage in storages.items():
            if not holders[key] <= include:
                continue  # also held by a kind that stays (an fp32 master is the parameter shard): it stays too
            source = _bytes_of(storage)
            host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(source, non_blocking=non_blocking and pin)
            # A device copy that is still reading is ordered before any reuse of the freed block: the caching
            # allocator hands it out again only to work queued after it on the same stream.
            storage.resize_(0)
            self._moved.append(_Moved(storage, host, frozenset(holders[key])))
            moved_bytes += host.numel()
        if self.device.type == "cuda":
            if not non_blocking:
                torch.cuda.current_stream(self.device).synchronize()
            torch.cuda.empty_cache()  # the generation engine beside us allocates outside torch's cache
        # With the parameters kept, the model still computes (generation while the rest sleeps).
        if OffloadStateTypeEnum.lp_params in self.asleep_kinds() and not self._guards:
            self._guards = _guard_every_module(module)
        return moved_bytes

    def reload(self, non_blocking: bool) -> None:
        """Puts every moved storage back on the device, with the bytes it had; nothing to do when awake."""
        for moved in self._moved:
            moved.storage.resize_(moved.host.numel())
            _bytes_of(moved.storage).copy_(moved.host, non_blocking=non_blocking and moved.host.is_pinned())
        if self.device.type == "cuda" and not non_blocking:
            torch.cuda.current_stream(self.device).synchronize()
        # Dropping a pinned host copy that a non-blocking copy still reads is safe: torch's pinned-memory allocator
        # records the copy's stream and hands the block out again only once the copy is done.
        self._moved = []
        self._asked = set()
        for guard in self._guards:
            guard.remove()
        self._guards = []

    def check_awake(self, what: str, needs: Iterable[OffloadStateTypeEnum] | None = None) -> None:
        """Refuses `what` while a kind it reads (`needs`; None: any) is asleep ([Note: every entry point while
        asleep])."""
        asleep = self.asleep_kinds()
        blocking = asleep if needs is None else asleep.intersection(needs)
        if blocking:
            raise RuntimeError(_asleep_message(what, blocking))

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host copies of the sleeping storages, by the `memory_breakdown` kind they count under."""
        out: dict[str, list[torch.Tensor]] = {}
        for moved in self._moved:
            first = next(kind for kind in HOST_KIND if kind in moved.kinds)
            out.setdefault(HOST_KIND[first], []).append(moved.host)
        return out


def _asleep_message(what: str, kinds: Iterable[OffloadStateTypeEnum]) -> str:
    names = ", ".join(sorted(kind.value for kind in kinds))
    return (
        f"{what} while the training state is offloaded (offload_states() moved {names} off the device): call "
        "engine.reload_states() first"
    )


def _guard_every_module(module: nn.Module) -> list[RemovableHandle]:
    """Hooks that refuse a forward or a `state_dict()` of `module` or of any sub-module (a sub-module call such as
    `model.model(...)` runs no hook of the root)."""
    guards = []
    for sub in module.modules():
        guards.append(sub.register_forward_pre_hook(_refuse_forward, prepend=True))
        guards.append(sub.register_state_dict_pre_hook(_refuse_state_dict))
    return guards


def _refuse_forward(module: nn.Module, args: object) -> None:
    raise RuntimeError(_asleep_message(f"forward of {type(module).__name__}", [OffloadStateTypeEnum.lp_params]))


def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if not keep_vars:  # keep_vars=True hands over the parameters without reading them (shapes, names)
        what = f"state_dict() of {type(module).__name__}"
        raise RuntimeError(_asleep_message(what, [OffloadStateTypeEnum.lp_params]))
