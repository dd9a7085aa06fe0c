"""Writing an engine's state as accelerate's FSDP `save_state` folders, so that an FSDP run resumes it.

[Note: accelerate's FSDP folders out]
The reverse of [Note: accelerate's FSDP folders] (accelerate_fsdp.py): `SHARDED_STATE_DICT` writes
`pytorch_model_fsdp_<i>/` with `dcp.save({"model": state_dict})` and `optimizer_<i>/` with
`dcp.save({"optimizer": optim_state_dict})`, both laid out as FSDP2's `get_model_state_dict` /
`get_optimizer_state_dict` give them at this world size (row blocks, [Note: DCP checkpoints out] in dcp_save.py),
the model's tied aliases (`lm_head.weight`) under their own names too, as FSDP2's state_dict lists them;
`FULL_STATE_DICT` writes `pytorch_model_fsdp[_<i>].bin` and `optimizer[_<i>].bin` (whole tensors, rank 0), what
the transformers FSDP Trainer reads by default. Values are the fp32 masters. Each folder or file is written under a
hidden name and renamed once every rank is done, so an interrupted save never leaves a half-written one under the
name a resume reads. The rest of the save_state folder (scheduler.bin, RNG states, samplers) is accelerate's own.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from accelerate_zero.checkpoint.accelerate_fsdp import model_dir, optimizer_dir
from accelerate_zero.checkpoint.dcp_save import gathered_state, world_mesh
from accelerate_zero.checkpoint.io import check_shared_folder
from accelerate_zero.engine import collectives


if TYPE_CHECKING:
    from accelerate_zero.checkpoint.engine_view import ZeroEngine


SHARDED, FULL = "SHARDED_STATE_DICT", "FULL_STATE_DICT"


def save_fsdp(
    engine: ZeroEngine, save_dir: str | os.PathLike[str], index: int = 0, state_dict_type: str = SHARDED
) -> None:
    """Writes the `index`-th model's state into `save_dir` as accelerate's FSDP save_state does ([Note: accelerate's
    FSDP folders out]); every rank must call it.

    Raises:
        ValueError: `state_dict_type` is neither SHARDED_STATE_DICT nor FULL_STATE_DICT.
        NotImplementedError: the engine splits its experts (expert_parallel).
    """
    if state_dict_type not in (SHARDED, FULL):
        raise ValueError(f"state_dict_type={state_dict_type!r}: expected {SHARDED!r} or {FULL!r}")
    if getattr(engine, "experts", None) is not None:
        raise NotImplementedError(
            "accelerate's FSDP layout with expert_parallel: FSDP checkpoints of split experts are not written yet; "
            "save the universal format (it loads at any expert-parallel size, or without expert parallelism)"
        )
    folder = Path(save_dir)
    world = engine.layout.world
    if world.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    check_shared_folder(
        folder,
        world.rank == 0,
        lambda: collectives.barrier(world),
        lambda obj: collectives.all_gather_object(obj, world),
        engine.layout.plan.nodes.node_of,
    )
    full = state_dict_type == FULL
    model_sd, optim_state, groups = gathered_state(
        engine, None if full else world_mesh(engine), full_on_main_only=full
    )
    aliases = _aliases(engine)
    model_sd.update({alias: model_sd[name] for alias, name in aliases.items() if name in model_sd})
    optimizer = {"state": optim_state, "param_groups": groups}
    suffix = "" if index == 0 else f"_{index}"
    if full:
        for name, value in ((f"pytorch_model_fsdp{suffix}.bin", model_sd), (f"optimizer{suffix}.bin", optimizer)):
            _published(engine, folder / name, functools.partial(_torch_save, value, world.rank == 0))
        return
    for name, value in ((model_dir(index), {"model": model_sd}), (optimizer_dir(index), {"optimizer": optimizer})):
        _published(engine, folder / name, functools.partial(_dcp_save, value, world.group))


def _torch_save(value: Any, is_main: bool, path: Path) -> None:
    if is_main:
        torch.save(value, path)


def _dcp_save(value: Any, group: Any, path: Path) -> None:
    dcp.save(value, storage_writer=dcp.FileSystemWriter(str(path)), process_group=group)


def _aliases(engine: ZeroEngine) -> dict[str, str]:
    """A tied parameter's other names -> the name `named_parameters()` gives it."""
    module = engine.checkpoint_state().module
    first = {id(p): name for name, p in module.named_parameters()}
    return {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False) if first[id(p)] != name}


def _published(engine: ZeroEngine, final: Path, write: Any) -> None:
    """`write(path)` on every rank into a hidden path, then rank 0 renames it to `final` (replacing an older one)."""
    world = engine.layout.world
    partial = final.with_name(f".{final.name}.partial")
    if world.rank == 0:
        _remove(partial)
    collectives.barrier(world)
    write(partial)
    collectives.barrier(world)
    if world.rank == 0:
        _remove(final)
        os.replace(partial, final)
    collectives.barrier(world)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
