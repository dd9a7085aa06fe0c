"""Memory accounting from the tensors actually held: each distinct storage counted once, under its first kind."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn


if TYPE_CHECKING:
    from accelerate_zero.engine.flat_buffer import GroupShard
    from accelerate_zero.engine.grad_reduce import GradReducer
    from accelerate_zero.engine.host_grads import HostStaging
    from accelerate_zero.engine.sharded_optimizer import ShardedOptimizer
    from accelerate_zero.engine.stage3.param_unit import ParamUnit
    from accelerate_zero.engine.stores import ShardStore
    from accelerate_zero.offload.host_memory import HostMemory
    from accelerate_zero.offload.policy import OffloadPolicy


class EngineState(Protocol):
    """What the accounting reads of an engine (engine/engine.py implements it; typed here so that this module, which
    the engine imports, does not import the engine back)."""

    module: nn.Module
    groups: list[GroupShard]
    units: list[ParamUnit]
    sharded_optimizer: ShardedOptimizer
    reducer: GradReducer
    offload: OffloadPolicy
    host_staging: HostStaging | None
    grad_store: Any
    shard_store: ShardStore
    host_memory: HostMemory
    sleeping: Any  # engine/sleep.py's SleepingState: host copies of what offload_states() moved
    activation_offload: Any  # engine/activation_offload.py's ActivationsToHost, or None


def bytes_by_kind(kinds: Mapping[str, Iterable[torch.Tensor]], chunks: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Sums the bytes of the distinct storages behind the tensors of each kind.

    A storage shared by several tensors (views, tied weights, fp32 master shards that are views of the
    parameters) is counted once, under the first kind that names it, so the kinds add up to `total`. A tensor cut
    from one of `chunks` (host memory's pinned chunks, offload/host_memory.py) counts its own bytes, not its
    chunk's: the chunk holds the buffers of every kind.

    Args:
        kinds: kind name -> tensors, in priority order.
        chunks: storages that buffers are cut from.

    Returns:
        Bytes per kind, plus "total".
    """
    chunk_storages = {chunk.untyped_storage().data_ptr() for chunk in chunks}
    seen: set[tuple[str, int]] = set()
    spans: list[tuple[int, int]] = []  # byte ranges of chunk buffers counted so far
    out: dict[str, int] = {}
    for kind, tensors in kinds.items():
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in chunk_storages:
                start = tensor.data_ptr()
                total += _uncounted(spans, start, start + tensor.numel() * tensor.element_size())
                continue
            key = (str(tensor.device), storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[kind] = total
    out["total"] = sum(out.values())
    return out


def _uncounted(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """The bytes of [start, end) that no span in `spans` (disjoint) covers; adds those pieces to `spans`."""
    pieces = [(start, end)]
    for lo, hi in spans:
        remaining = []
        for a, b in pieces:
            if hi <= a or b <= lo:
                remaining.append((a, b))
                continue
            remaining += [piece for piece in ((a, lo), (hi, b)) if piece[0] < piece[1]]
        pieces = remaining
    spans += pieces
    return sum(b - a for a, b in pieces)


def device_tensors(engine: EngineState) -> dict[str, list[torch.Tensor]]:
    """The engine's tensors on its compute device, by kind (what the offload policy keeps in host memory left out):
    what `memory_breakdown` counts, and what `offload_states` moves (engine/sleep.py)."""
    unit_shards = [flat.shard for unit in engine.units for flat in unit.flats]
    kept = engine.sharded_optimizer.held_tensors()
    return {
        "parameters": [
            *(shard.param_buffer for shard in engine.groups),
            *(flat.full for unit in engine.units for flat in unit.flats),
            *([] if engine.offload.params else unit_shards),
            *engine.module.parameters(),
        ],
        "gradients": engine.reducer.gradient_tensors(),
        "master_weights": [] if engine.offload.optimizer else kept["master_weights"],
        "optimizer_states": [] if engine.offload.optimizer else kept["optimizer_states"],
        "communication_buffers": engine.reducer.transient_tensors(),
    }


def engine_memory(engine: EngineState) -> dict[str, int]:
    """Implements `ZeroEngine.memory_breakdown` (see there): the engine's tensors by kind, device and host apart."""
    unit_shards = [flat.shard for unit in engine.units for flat in unit.flats]
    kept = engine.sharded_optimizer.held_tensors()
    host_grads = [t for b in engine.reducer.buckets if b.kept.in_host for t in b.kept.tensors()]
    host_grads += engine.host_staging.buffers if engine.host_staging is not None else []
    if engine.grad_store is not None:
        host_grads += engine.grad_store.resident_tensors()
    # Offloaded state lives in host memory: reported apart from what the compute device holds.
    host = {
        "host_parameters": unit_shards if engine.offload.params else [],
        "host_gradients": host_grads,
        "host_master_weights": kept["master_weights"] if engine.offload.optimizer else [],
        "host_optimizer_states": kept["optimizer_states"] if engine.offload.optimizer else [],
    }
    for kind, copies in engine.sleeping.host_tensors().items():  # asleep: the device's state, in host memory
        host[kind] = host[kind] + copies
    out = bytes_by_kind(device_tensors(engine))
    host_bytes = bytes_by_kind(host, engine.host_memory.chunks)
    if engine.activation_offload is not None:  # cpu_checkpointing: saved activations, held until backward
        host_bytes["host_activations"] = engine.activation_offload.stats.held_bytes
        host_bytes["total"] += host_bytes["host_activations"]
    host_bytes["host_total"] = host_bytes.pop("total")
    out.update(host_bytes)
    out["nvme_bytes"] = engine.sharded_optimizer.step_runner.file_bytes() + engine.shard_store.file_bytes()
    if engine.grad_store is not None:
        out["nvme_bytes"] += engine.grad_store.file_bytes()
    out["communication_buffers_peak"] = engine.reducer.peak_transient_bytes
    out["cached_buffers"] = bytes_by_kind({"cached": engine.reducer.cached_tensors()})["total"]
    return out
