"""Saving and loading a ZeroEngine's full training state in the universal format ([Note: universal checkpoints]).

Layout of `<save_dir>/<tag>/`:
    meta.json                 format, stage, world size, step counters, loss scale, parameter shapes, optimizer
                              class and hyperparameters, the resolved config, a SHA-256 of every other file and
                              of itself (rank 0; [Note: checkpoint integrity] in checkpoint/meta.py)
    rank00000.safetensors     per rank: `<name>@<start>:<end>/master` fp32 values of the parameter ranges it owns,
                              `.../<state>` their optimizer state, `.../param` stage-3 frozen shards; rank 0 also
                              `<name>/full` for parameters no rank shards and `<name>/buffer` for module buffers
    scheduler.pt, client_state.pt   (rank 0) read back with torch.load(weights_only=True)
Frozen parameters (`requires_grad=False`: a LoRA base) are left out unless `exclude_frozen_parameters=False`; meta.json
then records a fingerprint of each and loading takes them from the model after checking it ([Note: frozen
parameters are not saved] in checkpoint/frozen.py). Every value is copied to host memory one fragment at a time, never cloned on the device.
Nothing is ever unpickled beyond tensors and plain containers. Under NVMe offload the file format is the same:
the masters and optimizer state are read from (and on load written back to) the swap files one sub-group at a
time, and swapped parameter shards through the parameter store; a rank's file is written in parts as the fragments
come ([Note: a save streams its rank file in parts] in rank_parts.py), so a checkpoint never needs them all in memory.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from accelerate_zero.checkpoint import async_save as async_save_io
from accelerate_zero.checkpoint import dcp_read, rank_parts
from accelerate_zero.checkpoint.accelerate_fsdp import (
    fsdp_folders,
    full_state_files,
    missing_optimizer,
    read_full_state,
)
from accelerate_zero.checkpoint.dcp_load import load_dcp
from accelerate_zero.checkpoint.dcp_save import save_dcp
from accelerate_zero.checkpoint.deepspeed_universal import find_deepspeed_folder, read_any
from accelerate_zero.checkpoint.engine_view import ZeroEngine
from accelerate_zero.checkpoint.foreign_load import load_foreign
from accelerate_zero.checkpoint.fragment_load import check_optimizer, check_shapes, load_frozen, load_trainable
from accelerate_zero.checkpoint.fragments import Fragment, persistent_buffers, range_fragments, whole_key
from accelerate_zero.checkpoint.frozen import check_frozen, frozen_fingerprints, frozen_names
from accelerate_zero.checkpoint.io import (
    LATEST,
    FragmentReader,
    check_shared_folder,
    check_tag,
    fresh_partial_dir,
    publish_dir,
    resolve_tag,
)
from accelerate_zero.checkpoint.meta import FORMAT, check_file_set, file_digest, read_meta, verify_digests, write_meta
from accelerate_zero.checkpoint.model_export import export_files, not_a_checkpoint
from accelerate_zero.checkpoint.rank_parts import DIGEST_SUFFIX, RankPartWriter
from accelerate_zero.checkpoint.shaped_state import saved_state
from accelerate_zero.engine import collectives
from accelerate_zero.engine.checkpoint_state import CheckpointState, ShardRange, StepCounters, TrainableRange


if TYPE_CHECKING:
    pass


__all__ = ["FORMAT", "load_engine", "save_engine"]


def _names(state: CheckpointState) -> dict[int, str]:
    return {id(p): n for n, p in state.module.named_parameters()}


def _fragments(shard_range: ShardRange, names: dict[int, str]) -> list[Fragment]:
    return range_fragments(
        shard_range.plan, shard_range.params, names, shard_range.lo, shard_range.hi, shard_range.offsets
    )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of one fragment: a save never duplicates the shard on the device."""
    return tensor.detach().to("cpu", copy=True)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


# --------------------------------------------------------------------------- save
def save_engine(
    engine: ZeroEngine,
    save_dir: str | Path,
    tag: str | None,
    client_state: dict | None,
    exclude_frozen_parameters: bool = True,
    async_save: bool = False,
    checkpoint_format: str = "universal",
) -> Path:
    """Writes every rank's shard and the rank-independent state; returns the checkpoint folder.

    With `async_save`, returns once the state is snapshotted to host memory; a background thread writes and
    publishes it ([Note: asynchronous saves] in checkpoint/async_save.py). Any save or load first waits for the
    one in flight.
    """
    async_save_io.finish(engine.layout.world)  # a second save waits for the first
    save_dir = Path(save_dir)
    tag = check_tag(tag or f"global_step{engine.checkpoint_state().counters.global_steps}", "save_checkpoint tag")
    _validate_tag(engine, tag)
    if checkpoint_format == "dcp":
        _refuse_dcp_of_whole_parameters(engine)
        if async_save or client_state:
            raise ValueError("checkpoint_format='dcp' saves synchronously and without client_state: drop them")
        return save_dcp(engine, save_dir, tag)  # [Note: DCP checkpoints out] in checkpoint/dcp_save.py
    if checkpoint_format != "universal":
        raise ValueError(f"checkpoint_format={checkpoint_format!r}: expected 'universal' or 'dcp'")
    rank, is_main = engine.dp.rank, engine.layout.world.rank == 0
    state = engine.checkpoint_state()
    excluded = frozen_fingerprints(engine) if exclude_frozen_parameters and frozen_names(state) else {}
    work = fresh_partial_dir(save_dir, tag) if is_main else save_dir / f".{tag}.partial"
    world = engine.layout.world
    check_shared_folder(
        work,
        is_main,
        lambda: _barrier(engine),
        lambda obj: collectives.all_gather_object(obj, world),
        engine.layout.plan.nodes.node_of,
    )
    # At stage 0 every rank holds the same full state: rank 0's file is enough; with replicas of the shards
    # (engine/layout.py) the first replica's files are.
    writes = (engine.stage > 0 and engine.layout.writes_shards) or is_main
    host = _detached if async_save else _to_host  # an asynchronous save copies into its staging buffers
    tensors = _rank_tensors(state, is_main, set(excluded), host) if writes else None
    main_files = _main_files(engine, client_state, excluded) if is_main else None
    if not async_save:
        if tensors is not None:
            _write_rank_file(work, rank, tensors)
        _barrier(engine)
        if main_files is not None:
            _write_main_files(work, *main_files)
        return publish_dir(save_dir, tag, lambda: _barrier(engine), is_main)
    # [Note: asynchronous saves]: the snapshot is taken here, on the training thread.
    snapshot = None if tensors is None else async_save_io.stage(engine, tensors)
    main_files = copy.deepcopy(main_files)

    def write() -> None:
        try:
            if snapshot is not None:
                _write_rank_file(work, rank, iter(snapshot))
        except BaseException as error:
            async_save_io.mark_failed(work, rank, error)
            raise
        async_save_io.mark_done(work, rank)
        if main_files is not None:
            async_save_io.wait_for_ranks(work, world.world_size)
            _write_main_files(work, *main_files)
            publish_dir(save_dir, tag, lambda: None, is_main)  # every rank is done: no barrier needed

    async_save_io.start(engine, write)
    return save_dir / tag


def _write_rank_file(work: Path, rank: int, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    # [Note: a save streams its rank file in parts] in checkpoint/rank_parts.py
    writer = RankPartWriter(work, rank, lambda tensors, path: save_file(tensors, path), rank_parts.SAVE_PART_BYTES)
    for key, tensor in tensors:
        writer.add(key, tensor)
    writer.flush()


def _main_files(
    engine: ZeroEngine, client_state: dict | None, excluded: dict[str, list[float]]
) -> tuple[dict | None, dict, dict[str, Any]]:
    """Rank 0's files beside the rank files: the scheduler's state, the client state and meta.json's fields."""
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return scheduler, client_state or {}, {**_meta(engine), "frozen_fingerprints": excluded}


def _write_main_files(work: Path, scheduler: dict | None, client_state: dict, meta: dict[str, Any]) -> None:
    if scheduler is not None:
        torch.save(scheduler, work / "scheduler.pt")
    torch.save(client_state, work / "client_state.pt")
    write_meta(work, meta, _collect_digests(work))


def _collect_digests(work: Path) -> dict[str, str]:
    digests = {}
    for sidecar in sorted(work.glob("*" + DIGEST_SUFFIX)):
        digests[sidecar.name[: -len(DIGEST_SUFFIX)]] = sidecar.read_text().strip()
        sidecar.unlink()
    for name in ("scheduler.pt", "client_state.pt"):
        if (work / name).is_file():
            digests[name] = file_digest(work / name)
    return digests


def _rank_tensors(
    state: CheckpointState, is_main: bool, excluded: set[str], host: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, `host(value)`) of everything this rank saves, one fragment at a time (`host`: `_to_host`, or
    `_detached` for a consumer that copies each value before taking the next)."""
    names = _names(state)
    # Under NVMe optimizer offload the masters and their state are in memory one sub-group at a time.
    for batch in state.trainable_batches(write_back=False):
        for trainable in batch:
            yield from _trainable_tensors(state, trainable, names, host)
    for frozen in state.frozen_shards():
        shard = state.read_frozen(frozen)
        for frag in _fragments(frozen.range, names):
            if frag.name not in excluded:
                yield frag.key("param"), host(shard[frag.offset : frag.offset + frag.numel])
    covered = state.sharded_parameters()
    for name, param in state.module.named_parameters():
        offset = state.part_of_whole(param)
        if id(param) in covered or name in excluded:
            continue
        if offset is not None and state.writes_parts:  # a frozen split expert: its range of the whole tensor
            yield Fragment(name, offset, offset + param.numel(), 0).key("param"), host(param.reshape(-1))
        elif offset is None and is_main:
            yield whole_key(name, "full"), host(param)
    if is_main:
        for name, buffer in persistent_buffers(state.module):
            yield whole_key(name, "buffer"), host(buffer)


def _trainable_tensors(
    state: CheckpointState,
    trainable: TrainableRange,
    names: dict[int, str],
    host: Callable[[torch.Tensor], torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    optimizer_state = state.optimizer.state.get(trainable.master, {})
    master = trainable.flat_master
    for frag in _fragments(trainable.range, names):
        piece = slice(frag.offset, frag.offset + frag.numel)
        yield frag.key("master"), host(master[piece]).float()
        for kind, value in optimizer_state.items():
            if torch.is_tensor(value):  # [Note: state in a parameter's own shape]
                yield frag.key(kind), host(saved_state(value, piece, master.numel(), trainable.whole, frag, kind))


def _meta(engine: ZeroEngine) -> dict[str, Any]:
    state = engine.checkpoint_state()
    counters = state.counters
    scaler = state.loss_scaler
    return {
        "format": FORMAT,
        "stage": engine.stage,
        "world_size": engine.dp.world_size,
        "global_steps": counters.global_steps,
        "micro_steps": counters.micro_steps,
        "skipped_steps": counters.skipped_steps,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "param_shapes": state.param_shapes(),
        "optimizer": type(state.optimizer).__name__,
        "param_groups": [
            {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple))}
            for group in state.optimizer.param_groups
        ],
        "config": engine.config.to_dict(),
    }


# --------------------------------------------------------------------------- load
def load_engine(
    engine: ZeroEngine,
    load_dir: str | Path,
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
) -> tuple[Path, dict]:
    """Restores weights (and optimizer, scheduler, counters) from a checkpoint of any world size or stage, from
    a DCP checkpoint written by FSDP2 or torchtitan (`load_dir`, or `load_dir/tag`, holding `.metadata`), or from a
    DeepSpeed ZeRO or universal checkpoint (`load_dir` holding `latest` / `latest_universal`, `load_dir/tag`, or the
    tag folder itself; checkpoint/deepspeed_read.py, deepspeed_universal.py).

    Returns:
        (the checkpoint folder, the client state saved with it).

    Raises:
        ValueError: the checkpoint is corrupted (naming the file), its parameter shapes differ from the model's, or
            it was saved with another optimizer class and `load_optimizer_states` is True.
    """
    async_save_io.finish(engine.layout.world)  # a save in flight publishes first (it may be the one loaded)
    if tag is not None:
        check_tag(tag, "tag")
    other = _load_other_format(engine, Path(load_dir), tag, load_optimizer_states, load_lr_scheduler_states)
    if other is not None:
        return other
    folder = resolve_tag(Path(load_dir), tag)
    meta = read_meta(folder)
    files = check_file_set(folder, meta)
    state = engine.checkpoint_state()
    check_shapes(state, meta, folder)
    if load_optimizer_states:
        check_optimizer(state, meta, folder)
    from_model = check_frozen(engine, meta, folder)
    reader = FragmentReader(files)
    names = _names(state)
    _verify_what_this_rank_reads(engine, state, reader, names, from_model, folder, meta)
    with torch.no_grad():
        load_trainable(state, reader, names, load_optimizer_states)
        load_frozen(state, reader, names, from_model)
        state.finish_load()
    if load_optimizer_states:
        for group, saved in zip(state.optimizer.param_groups, meta["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k in group})
        scaler = state.loss_scaler
        if scaler is not None and meta["loss_scaler"] is not None:
            scaler.load_state_dict(meta["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and (folder / "scheduler.pt").exists():
        engine.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    state.restore_counters(StepCounters(meta["global_steps"], meta["micro_steps"], meta["skipped_steps"]))
    engine.zero_grad()
    return folder, torch.load(folder / "client_state.pt", weights_only=True)


def _load_other_format(
    engine: ZeroEngine, load_dir: Path, tag: str | None, load_optimizer_states: bool, load_lr_scheduler_states: bool
) -> tuple[Path, dict] | None:
    """Loads the folder when it is another framework's (accelerate's FSDP save_state, DCP, DeepSpeed) and returns
    (folder, client state); None when it is none of them; a model export is refused by name.

    Raises:
        NotImplementedError: a foreign folder and an engine that splits its experts (expert_parallel).
        ValueError: a model export, or an FSDP save without its optimizer state while it is to be loaded.
    """
    named = load_dir if tag is None else load_dir / tag
    fsdp, full = fsdp_folders(load_dir, tag), full_state_files(load_dir, tag)
    deepspeed = None if fsdp or full or dcp_read.is_dcp_folder(named) else find_deepspeed_folder(load_dir, tag)
    if not (fsdp or full or deepspeed or dcp_read.is_dcp_folder(named)):
        exported = export_files(named)
        if exported and not (named / LATEST).is_file():
            raise ValueError(not_a_checkpoint(named, exported))
        return None
    if (fsdp or full or deepspeed) and getattr(engine, "experts", None) is not None:
        raise NotImplementedError(
            f"{named} is another framework's checkpoint (accelerate FSDP or DeepSpeed) and this engine splits its "
            "experts (expert_parallel): loading it into split experts is not available yet; load it without "
            "expert_parallel, save the universal (or DCP) format, and load that"
        )
    if fsdp is not None:  # [Note: accelerate's FSDP folders] in checkpoint/accelerate_fsdp.py
        model, optimizer = fsdp
        if load_optimizer_states and not dcp_read.is_dcp_folder(optimizer):
            raise ValueError(missing_optimizer(model, optimizer))
        optimizer_folder = optimizer if load_optimizer_states else None
        _refuse_dcp_of_whole_parameters(engine)
        return model, load_dcp(engine, model, load_optimizer_states, load_lr_scheduler_states, optimizer_folder)
    if full is not None:
        model_file, optimizer_file = full
        if load_optimizer_states and not optimizer_file.is_file():
            raise ValueError(missing_optimizer(model_file, optimizer_file))
        read = lambda: read_full_state(model_file, optimizer_file if load_optimizer_states else None)  # noqa: E731
        return load_foreign(engine, read, load_optimizer_states, load_lr_scheduler_states)
    if deepspeed is not None:  # [Note: foreign checkpoints through our fragments] in checkpoint/pieces.py
        return load_foreign(engine, lambda: read_any(deepspeed), load_optimizer_states, load_lr_scheduler_states)
    # [Note: DCP checkpoints in] in checkpoint/dcp_load.py
    _refuse_dcp_of_whole_parameters(engine)
    return named, load_dcp(engine, named, load_optimizer_states, load_lr_scheduler_states)


def _verify_what_this_rank_reads(
    engine: ZeroEngine,
    state: CheckpointState,
    reader: FragmentReader,
    names: dict[int, str],
    from_model: set[str],
    folder: Path,
    meta: dict[str, Any],
) -> None:
    """[Note: each rank verifies what it reads] in checkpoint/meta.py: this rank hashes the files its ranges and
    whole tensors come from; every rank raises the first problem any rank found.

    Raises:
        ValueError: naming a damaged file (on every rank, whichever rank read it).
    """
    ranges = [*state.trainable_ranges(), *(shard.range for shard in state.frozen_shards())]
    wanted = [(f.name, f.start, f.end) for r in ranges for f in _fragments(r, names) if f.name not in from_model]
    covered = state.sharded_parameters()
    whole = [whole_key(n, "full") for n, p in state.module.named_parameters() if id(p) not in covered]
    whole += [whole_key(n, "buffer") for n, _ in state.module.named_buffers()]
    problems = verify_digests(folder, meta, reader.files_for(wanted, whole))
    found = collectives.all_gather_object(problems, engine.layout.world)
    first = next((problem for rank_problems in found for problem in rank_problems), None)
    if first is not None:
        raise ValueError(first)


def _refuse_dcp_of_whole_parameters(engine: ZeroEngine) -> None:
    if engine.checkpoint_state().steps_whole_parameters:
        raise NotImplementedError(
            "DCP checkpoints of an optimizer that steps whole parameters (Adafactor, Muon, 8-bit: "
            "engine/owned_step.py) are not available yet: their state keeps its own shapes; use the universal format"
        )


def _validate_tag(engine: ZeroEngine, tag: str) -> None:
    """DeepSpeed's `checkpoint.tag_validation`: every rank must save under the same tag."""
    mode = engine.config.checkpoint.tag_validation
    if mode == "IGNORE" or engine.layout.world.world_size == 1:
        return
    tags = collectives.all_gather_object(tag, engine.layout.world)
    if len(set(tags)) > 1:
        message = f"checkpoint tags differ across ranks: {tags}; pass the same tag on every rank"
        if mode == "FAIL":
            raise ValueError(message + " (checkpoint.tag_validation=FAIL)")
        warnings.warn(message, stacklevel=3)


def _barrier(engine: ZeroEngine) -> None:
    collectives.barrier(engine.layout.world)
