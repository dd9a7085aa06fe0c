"""Saving an engine's state as a DCP checkpoint that FSDP2 loads ([Note: DCP checkpoints out]).

[Note: DCP checkpoints out]
`save_checkpoint(dir, checkpoint_format="dcp")` writes what an FSDP2 user reads back with
`dcp.load({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt), ...})` and then
`set_model_state_dict` / `set_optimizer_state_dict`: `model.<name>` (fp32 values), `optim.state.<name>.<state>`,
`optim.param_groups.<i>.*` (with the parameter names), `lr_scheduler.*` (the engine's scheduler) and
`train_state.step`. Our shards are element ranges of flattened parameters, which are not the row blocks DCP's
chunks describe; so, one parameter at a time, the ranks holding pieces of it (one replica; at stage 0 rank 0)
put them into a zero tensor of its full size and sum it over the ranks (no piece is held twice: the sum is exact;
a split layer's experts are placed at their range of the whole layer, [Note: expert parallelism in the engine]),
and each rank keeps rows `torch.chunk(rows, W)[rank]` as a `Shard(0)` DTensor, FSDP2's own layout at the same
world size. Host memory: this rank's row blocks of everything, plus one full parameter while it is assembled. The
folder is written as `.<tag>.partial` and published as engine checkpoints are (checkpoint/io.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from accelerate_zero.checkpoint.fragments import persistent_buffers, range_fragments
from accelerate_zero.checkpoint.io import check_shared_folder, fresh_partial_dir, publish_dir
from accelerate_zero.engine import collectives


if TYPE_CHECKING:
    from accelerate_zero.checkpoint.engine_view import ZeroEngine
    from accelerate_zero.engine.checkpoint_state import CheckpointState


def _pieces(state: CheckpointState, contributes: bool) -> tuple[dict, dict, dict]:
    """This rank's pieces: {(name, kind): [(start, end, values)]}, {name: step}, {group index: names}."""
    names = {id(p): n for n, p in state.module.named_parameters()}
    pieces: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
    steps: dict[str, float] = {}
    groups: dict[int, set[str]] = {}
    group_of = {id(p): i for i, g in enumerate(state.optimizer.param_groups) for p in g["params"]}
    for batch in state.trainable_batches(write_back=False):
        for trainable in batch:
            r = trainable.range
            frags = range_fragments(r.plan, r.params, names, r.lo, r.hi, r.offsets)  # split experts: whole ranges
            kept = state.optimizer.state.get(trainable.master, {})
            for frag in frags:
                groups.setdefault(group_of[id(trainable.master)], set()).add(frag.name)
                if not contributes:
                    continue
                piece = slice(frag.offset, frag.offset + frag.numel)
                pieces.setdefault((frag.name, "param"), []).append(
                    (frag.start, frag.end, trainable.master[piece].cpu())
                )
                for kind, value in kept.items():
                    if torch.is_tensor(value) and value.ndim > 0 and value.numel() == trainable.master.numel():
                        pieces.setdefault((frag.name, kind), []).append((frag.start, frag.end, value[piece].cpu()))
                    elif torch.is_tensor(value) and value.numel() == 1:
                        steps[frag.name] = float(value)
    for frozen in state.frozen_shards() if contributes else []:
        shard = state.read_frozen(frozen)
        r = frozen.range
        for frag in range_fragments(r.plan, r.params, names, r.lo, r.hi, r.offsets):
            values = shard[frag.offset : frag.offset + frag.numel].float().cpu()
            pieces.setdefault((frag.name, "param"), []).append((frag.start, frag.end, values))
    covered = state.sharded_parameters()
    for name, param in state.module.named_parameters():
        offset = state.part_of_whole(param)
        if id(param) not in covered and offset is not None and state.writes_parts:  # a frozen split expert
            values = param.detach().reshape(-1).float().cpu()
            pieces.setdefault((name, "param"), []).append((offset, offset + values.numel(), values))
    return pieces, steps, groups


def _row_block(full: torch.Tensor, mesh: DeviceMesh, rank: int, world_size: int) -> torch.Tensor:
    if full.ndim == 0:
        return full
    chunks = torch.chunk(full, world_size, dim=0)
    local = chunks[rank].clone() if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def world_mesh(engine: ZeroEngine) -> DeviceMesh | None:
    """The engine's world as a one-dimensional device mesh (FSDP2's layout at this world size); None on one rank."""
    world = engine.layout.world
    group = world.group if world.group is not None else torch.distributed.group.WORLD  # None: the default group
    return DeviceMesh.from_group(group, engine.device.type) if world.world_size > 1 else None


def gathered_state(
    engine: ZeroEngine, mesh: DeviceMesh | None, full_on_main_only: bool = False
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The model state_dict (fp32 masters, persistent buffers), the optimizer state keyed by parameter name and the
    param groups (with parameter names), as FSDP2's `get_model_state_dict` / `get_optimizer_state_dict` give them:
    row blocks `Shard(0)` over `mesh`, or, `mesh` None, whole tensors (kept on rank 0 only with `full_on_main_only`).
    Every rank must call it ([Note: DCP checkpoints out])."""
    world = engine.layout.world
    is_main = world.rank == 0
    state = engine.checkpoint_state()
    contributes = (engine.stage > 0 and engine.layout.writes_shards) or is_main
    pieces, steps, groups = _pieces(state, contributes)
    all_kinds: dict[str, set[str]] = {}
    for rank_kinds in collectives.all_gather_object({k for k in pieces}, world):
        for name, kind in rank_kinds:
            all_kinds.setdefault(name, set()).add(kind)
    all_steps: dict[str, float] = {}
    all_groups: dict[int, set[str]] = {}
    for rank_steps, rank_groups in collectives.all_gather_object((steps, groups), world):
        all_steps.update(rank_steps)
        for index, group_names in rank_groups.items():
            all_groups.setdefault(index, set()).update(group_names)
    shapes = state.param_shapes()
    covered = state.sharded_parameters()
    model_sd: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    for name, param in state.module.named_parameters():
        shape = shapes[name]
        kinds = sorted(all_kinds.get(name, set()) | ({"param"} if id(param) not in covered else set()))
        for kind in kinds:
            full = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
            if id(param) not in covered and kind == "param" and state.part_of_whole(param) is None:
                if is_main:
                    full.copy_(param.detach().reshape(-1).float().cpu())
            for start, end, values in pieces.get((name, kind), []):
                full[start:end] = values
            full = full.to(engine.device)
            collectives.all_reduce(full, world, engine.comm_stats_counter, kind="checkpoint")
            full = full.cpu().reshape(shape)
            if mesh is not None:
                block = _row_block(full, mesh, world.rank, world.world_size)
            elif full_on_main_only and not is_main:
                continue
            else:
                block = full
            if kind == "param":
                model_sd[name] = block
            else:
                optim_state.setdefault(name, {})[kind] = block
        if name in all_steps:
            optim_state.setdefault(name, {})["step"] = torch.tensor(all_steps[name], dtype=torch.float32)
    for name, buffer in persistent_buffers(state.module):
        model_sd[name] = buffer.detach().cpu().clone()
    order = [name for name, _ in state.module.named_parameters()]
    param_groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [n for n in order if n in all_groups.get(index, set())],
        }
        for index, group in enumerate(state.optimizer.param_groups)
    ]
    return model_sd, optim_state, param_groups


def save_dcp(engine: ZeroEngine, save_dir: Path, tag: str) -> Path:
    """Writes `save_dir/tag` as a DCP checkpoint ([Note: DCP checkpoints out]); every rank must call it.

    Returns:
        The checkpoint folder.
    """
    world = engine.layout.world
    is_main = world.rank == 0
    work = fresh_partial_dir(save_dir, tag) if is_main else save_dir / f".{tag}.partial"
    barrier = lambda: collectives.barrier(world)  # noqa: E731
    check_shared_folder(
        work, is_main, barrier, lambda obj: collectives.all_gather_object(obj, world), engine.layout.plan.nodes.node_of
    )
    state = engine.checkpoint_state()
    model_sd, optim_state, param_groups = gathered_state(engine, world_mesh(engine))
    to_save: dict[str, Any] = {
        "model": model_sd,
        "optim": {"state": optim_state, "param_groups": param_groups},
        "train_state": {"step": state.counters.global_steps},
    }
    if engine.lr_scheduler is not None:
        to_save["lr_scheduler"] = engine.lr_scheduler.state_dict()
    dcp.save(to_save, storage_writer=dcp.FileSystemWriter(str(work)), process_group=world.group)
    return publish_dir(save_dir, tag, barrier, is_main)
