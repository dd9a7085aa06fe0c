"""Saving and loading a ZeroEngine's full training state in the universal format ([Note: universal checkpoints]).

Layout of `<save_dir>/<tag>/`:
    meta.json                 format, stage, world size, step counters, loss scale, parameter shapes, optimizer
                              hyperparameters, the resolved config (rank 0)
    rank00000.safetensors     per rank: `<name>@<start>:<end>/master` fp32 values of the parameter ranges it owns,
                              `.../<state>` their optimizer state, `.../param` stage-3 frozen shards; rank 0 also
                              `<name>/full` for parameters no rank shards and `<name>/buffer` for module buffers
    scheduler.pt, client_state.pt   (rank 0) read back with torch.load(weights_only=True)
Nothing is ever unpickled beyond tensors and plain containers. Under NVMe offload the file format is the same:
the masters and optimizer state are read from (and on load written back to) the swap files one sub-group at a
time, and swapped parameter shards through the parameter store, so a checkpoint never needs them all in memory.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from accelerate_zero.checkpoint.fragments import Fragment, range_fragments, whole_key
from accelerate_zero.checkpoint.io import FragmentReader, partial_dir, publish_dir, resolve_tag


if TYPE_CHECKING:
    from accelerate_zero.engine.engine import ZeroEngine
    from accelerate_zero.engine.sharded_optimizer import ShardSlice
    from accelerate_zero.engine.stage3.param_unit import FlatUnitBuffer

FORMAT = "accelerate_zero/1"


def _names(engine: ZeroEngine) -> dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


def _slice_fragments(shard_slice: ShardSlice, names: dict[int, str]) -> list[Fragment]:
    bucket = shard_slice.bucket
    lo = bucket.plan.shard_range(bucket.rank)[0]
    return range_fragments(bucket.plan, bucket.params, names, lo + shard_slice.start, lo + shard_slice.end)


def _flat_fragments(flat: FlatUnitBuffer, names: dict[int, str]) -> list[Fragment]:
    return range_fragments(flat.plan, flat.params, names, *flat.plan.shard_range(flat.rank))


def _frozen_flats(engine: ZeroEngine) -> list[FlatUnitBuffer]:
    return [flat for unit in engine.units for flat in unit.flats if flat is not unit.trainable]


def _covered(engine: ZeroEngine) -> set[int]:
    """Parameters whose values live in shards (trainable slices, stage-3 frozen flats)."""
    covered = {id(p) for s in engine.sharded_optimizer.slices for p in s.bucket.params}
    return covered | {id(p) for flat in _frozen_flats(engine) for p in flat.params}


# --------------------------------------------------------------------------- save
def save_engine(engine: ZeroEngine, save_dir: str | Path, tag: str | None, client_state: dict | None) -> Path:
    """Writes every rank's shard and the rank-independent state; returns the checkpoint folder."""
    save_dir = Path(save_dir)
    tag = tag or f"global_step{engine.global_steps}"
    _validate_tag(engine, tag)
    rank, is_main = engine.dp.rank, engine.dp.rank == 0
    work = partial_dir(save_dir, tag)
    if is_main:
        work.mkdir(parents=True, exist_ok=True)
    _barrier(engine)
    # At stage 0 every rank holds the same full state: rank 0's file is enough.
    if engine.stage > 0 or is_main:
        save_file(_rank_tensors(engine, is_main), str(work / f"rank{rank:05d}.safetensors"))
    if is_main:
        (work / "meta.json").write_text(json.dumps(_meta(engine), indent=1))
        if engine.lr_scheduler is not None:
            torch.save(engine.lr_scheduler.state_dict(), work / "scheduler.pt")
        torch.save(client_state or {}, work / "client_state.pt")
    return publish_dir(save_dir, tag, lambda: _barrier(engine), is_main)


def _rank_tensors(engine: ZeroEngine, is_main: bool) -> dict[str, torch.Tensor]:
    names, out = _names(engine), {}
    # Under NVMe optimizer offload the masters and their state are in memory one sub-group at a time.
    for slices in engine.sharded_optimizer.resident_slices(write_back=False):
        for shard_slice in slices:
            out.update(_slice_tensors(engine, shard_slice, names))
    for flat in _frozen_flats(engine):
        shard = _shard_values(engine, flat)
        for frag in _flat_fragments(flat, names):
            out[frag.key("param")] = shard[frag.offset : frag.offset + frag.numel].clone()
    if is_main:
        covered = _covered(engine)
        for name, param in engine.module.named_parameters():
            if id(param) not in covered:
                out[whole_key(name, "full")] = param.detach().clone()
        for name, buffer in engine.module.named_buffers():
            out[whole_key(name, "buffer")] = buffer.detach().clone()
    return {key: value.contiguous() for key, value in out.items()}


def _slice_tensors(engine: ZeroEngine, shard_slice: ShardSlice, names: dict[int, str]) -> dict[str, torch.Tensor]:
    out = {}
    state = engine.optimizer.state.get(shard_slice.master, {})
    for frag in _slice_fragments(shard_slice, names):
        piece = slice(frag.offset, frag.offset + frag.numel)
        out[frag.key("master")] = shard_slice.master.detach()[piece].float().clone()
        for kind, value in state.items():
            if torch.is_tensor(value) and value.numel() == shard_slice.master.numel() and value.ndim > 0:
                out[frag.key(kind)] = value.detach()[piece].clone()
            elif torch.is_tensor(value) and value.numel() == 1:
                out[frag.key(kind)] = value.detach().reshape(()).clone()
    return out


def _meta(engine: ZeroEngine) -> dict[str, Any]:
    scaler = engine.sharded_optimizer.loss_scaler
    return {
        "format": FORMAT,
        "stage": engine.stage,
        "world_size": engine.dp.world_size,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "param_shapes": _param_shapes(engine),
        "optimizer": type(engine.optimizer).__name__,
        "param_groups": [
            {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple))}
            for group in engine.optimizer.param_groups
        ],
        "config": engine.config.to_dict(),
    }


def _param_shapes(engine: ZeroEngine) -> dict[str, list[int]]:
    """Every parameter's real shape; at stage 3 from the unit plans (the parameters hold empty placeholders), so a
    checkpoint can be consolidated without the model."""
    planned = {
        id(flat.params[slot.param_index]): list(slot.shape)
        for unit in engine.units
        for flat in unit.flats
        for slot in flat.plan.slots
    }
    return {n: planned.get(id(p), list(p.shape)) for n, p in engine.module.named_parameters()}


# --------------------------------------------------------------------------- load
def load_engine(
    engine: ZeroEngine,
    load_dir: str | Path,
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
) -> dict:
    """Restores weights (and optimizer, scheduler, counters) from a checkpoint of any world size or stage."""
    folder = resolve_tag(Path(load_dir), tag)
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder} is not an accelerate_zero checkpoint (format={meta.get('format')!r})")
    reader = FragmentReader(sorted(folder.glob("rank*.safetensors")))
    names = _names(engine)
    with torch.no_grad():
        _load_slices(engine, reader, names, load_optimizer_states)
        _load_frozen(engine, reader, names)
        engine.sharded_optimizer.publish()
    if load_optimizer_states:
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"], strict=False):
            group.update({k: v for k, v in saved.items() if k in group})
        scaler = engine.sharded_optimizer.loss_scaler
        if scaler is not None and meta["loss_scaler"] is not None:
            scaler.load_state_dict(meta["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and (folder / "scheduler.pt").exists():
        engine.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine.skipped_steps = meta["skipped_steps"]
    engine.zero_grad()
    return torch.load(folder / "client_state.pt", weights_only=True)


def _values(reader: FragmentReader, frag: Fragment) -> torch.Tensor:
    for kind in ("master", "param"):
        found = reader.read_range(frag.name, kind, frag.start, frag.end)
        if found is not None:
            return found
    full = reader.read_whole(whole_key(frag.name, "full"))
    if full is None:
        raise ValueError(f"the checkpoint has no values for parameter {frag.name!r}: was it saved from this model?")
    return full.reshape(-1)[frag.start : frag.end]


def _load_slices(engine: ZeroEngine, reader: FragmentReader, names: dict[int, str], with_state: bool) -> None:
    sharded = engine.sharded_optimizer
    for slices in sharded.resident_slices(write_back=True):
        for shard_slice in slices:
            master = shard_slice.master
            fragments = _slice_fragments(shard_slice, names)
            for frag in fragments:
                master[frag.offset : frag.offset + frag.numel].copy_(_values(reader, frag))
            sharded.write_params([shard_slice])
            if with_state and fragments:
                engine.optimizer.state[master] = _slice_state(reader, fragments, master, _group_of(engine, master))
    if engine.param_store is not None:
        engine.param_store.flush()


def _group_of(engine: ZeroEngine, master: torch.Tensor) -> dict[str, Any]:
    return next(g for g in engine.optimizer.param_groups if any(p is master for p in g["params"]))


def _slice_state(
    reader: FragmentReader, fragments: list[Fragment], master: torch.Tensor, group: dict[str, Any]
) -> dict[str, torch.Tensor]:
    kinds = set().union(*(reader.kinds_of(f.name) for f in fragments)) - {"master", "param"}
    state = {}
    # As torch.optim's load_state_dict: fused and capturable kernels keep their scalars (`step`) as fp32 on the
    # parameter's device; the others keep them on the CPU.
    scalar_device = master.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    for kind in sorted(kinds):
        scalar = reader.read_scalar(fragments[0].name, kind, fragments[0].start, fragments[0].end)
        if scalar is not None and scalar.ndim == 0:
            dtype = torch.float32 if kind == "step" else scalar.dtype
            state[kind] = scalar.to(device=scalar_device, dtype=dtype, copy=True)
            continue
        values = torch.zeros_like(master)
        for frag in fragments:
            piece = reader.read_range(frag.name, kind, frag.start, frag.end)
            if piece is not None:
                values[frag.offset : frag.offset + frag.numel].copy_(piece)
        state[kind] = values
    return state


def _load_frozen(engine: ZeroEngine, reader: FragmentReader, names: dict[int, str]) -> None:
    store = engine.param_store
    for flat in _frozen_flats(engine):
        shard = _shard_values(engine, flat)
        for frag in _flat_fragments(flat, names):
            shard[frag.offset : frag.offset + frag.numel].copy_(_values(reader, frag))
        if shard is not flat.shard:
            store.overwrite(flat, shard)
    if store is not None:
        store.flush()
    covered = _covered(engine)
    for name, param in engine.module.named_parameters():
        if id(param) in covered:
            continue
        full = reader.read_whole(whole_key(name, "full"))
        if full is None:
            full = _values(reader, Fragment(name, 0, param.numel(), 0)).reshape(param.shape)
        param.data.copy_(full)
    for name, buffer in engine.module.named_buffers():
        saved = reader.read_whole(whole_key(name, "buffer"))
        if saved is not None:
            buffer.copy_(saved)


def _shard_values(engine: ZeroEngine, flat: FlatUnitBuffer) -> torch.Tensor:
    """A stage-3 flat's shard, read from its file under NVMe parameter offload."""
    store = engine.param_store
    return store.read(flat) if store is not None and store.swapped(flat) else flat.shard


def _validate_tag(engine: ZeroEngine, tag: str) -> None:
    """DeepSpeed's `checkpoint.tag_validation`: every rank must save under the same tag."""
    mode = engine.config.checkpoint.tag_validation
    if mode == "IGNORE" or engine.dp.world_size == 1:
        return
    tags: list[str | None] = [None] * engine.dp.world_size
    dist.all_gather_object(tags, tag, group=engine.dp.group)
    if len(set(tags)) > 1:
        message = f"checkpoint tags differ across ranks: {tags}; pass the same tag on every rank"
        if mode == "FAIL":
            raise ValueError(message + " (checkpoint.tag_validation=FAIL)")
        warnings.warn(message, stacklevel=3)


def _barrier(engine: ZeroEngine) -> None:
    if engine.dp.world_size > 1:
        dist.barrier(group=engine.dp.group)
