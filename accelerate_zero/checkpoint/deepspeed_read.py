"""Reading a DeepSpeed ZeRO checkpoint folder (`engine.save_checkpoint`, stages 1-3) as a `ForeignCheckpoint`.

[Note: DeepSpeed's ZeRO layouts]
A DeepSpeed tag folder holds `mp_rank_00_model_states.pt` (stages 1-2: the module's state_dict, whole) or one
`zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank (stage 3: the module's parameters empty, `frozen_param_fragments`
this rank's share of the frozen ones), with `param_shapes` (per group, the trained parameters in the order they were
flattened), `global_steps`, `skipped_steps`, `lr_scheduler` (its state_dict) and any client state; and one
`[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank holding its partition:
- stages 1-2: per group, the group's parameters flattened in `param_shapes` order (`param_alignment_paddings` after
  each) and cut into `partition_count` equal partitions; rank r's fp32 masters are
  `single_partition_of_fp32_groups[g]` (the group's end padding removed: add `group_paddings[g]` for the partition
  size) and its Adam state `base_optimizer_state["state"][g]` (or `[g]` of a list, `elastic_checkpoint`);
- stage 3: per sub-group, every parameter cut on its own into `ceil(numel / partition_count)` elements per rank,
  rank r's pieces concatenated in `param_shapes` order: `fp32_flat_groups[i]` and `optimizer_state_dict["state"][i]`.
Each piece becomes an element range of a named parameter ([Note: foreign checkpoints through our fragments] in
pieces.py). The files are read with the restricted unpickler ([Note: reading foreign pickles] in safe_pickle.py),
memory-mapped: a rank pays for the slices its ranges touch. Pipeline or tensor parallel folders (`mp_rank_01`,
...) are refused by name.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from accelerate_zero.checkpoint.foreign import ForeignCheckpoint, loss_scaler_state, plain_param_groups
from accelerate_zero.checkpoint.pieces import Piece, PieceReader
from accelerate_zero.checkpoint.safe_pickle import foreign_name, load_foreign


MODEL_STATES = "mp_rank_00_model_states.pt"
_STAGE3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_OTHER_MP = re.compile(r"mp_rank_(?!00)\d+")
KNOWN_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "mp_rank_00_model_states",
}  # fmt: skip
"""The keys DeepSpeed's engine writes into a model-states file; any other is the client state."""


def is_deepspeed_folder(folder: Path) -> bool:
    """Whether `folder` is a DeepSpeed tag folder (it holds a model-states file)."""
    return (folder / MODEL_STATES).is_file() or any(_STAGE3_MODEL.match(p.name) for p in _listing(folder))


def _listing(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _rank_files(folder: Path, pattern: re.Pattern[str], group: int) -> dict[int, Path]:
    return {int(m.group(group)): p for p in _listing(folder) if (m := pattern.match(p.name))}


def _contiguous(files: dict[int, Path], count: int, folder: Path, what: str) -> list[Path]:
    missing = [r for r in range(count) if r not in files]
    if missing:
        raise ValueError(
            f"{folder} is a DeepSpeed checkpoint of {count} ranks but has no {what} file for rank(s) {missing} "
            f"(e.g. zero_pp_rank_{missing[0]}_mp_rank_00_{what}.pt): copy the whole tag folder"
        )
    return [files[r] for r in range(count)]


def read_deepspeed(folder: Path) -> ForeignCheckpoint:
    """The DeepSpeed ZeRO checkpoint in the tag folder `folder` ([Note: DeepSpeed's ZeRO layouts]).

    Raises:
        ValueError: a file is missing, damaged or names a class we do not read (naming it), the folder is of a
            pipeline/tensor-parallel run or of ZeRO stage 0, or its layout does not add up.
    """
    others = sorted(p.name for p in _listing(folder) if _OTHER_MP.search(p.name))
    if others:
        raise ValueError(
            f"{folder} is a DeepSpeed checkpoint of a tensor- or pipeline-parallel run ({others[0]}, ...): only data "
            "parallel ZeRO checkpoints load here; convert it with DeepSpeed's ds_to_universal first"
        )
    stage3_models = _rank_files(folder, _STAGE3_MODEL, 1)
    optim_files = _rank_files(folder, _OPTIM, 2)
    first = folder / MODEL_STATES if not stage3_models else stage3_models[min(stage3_models)]
    model = _model_states(first)
    if not optim_files:
        stage = (model.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0)
        raise ValueError(
            f"{folder} is a DeepSpeed checkpoint without ZeRO partition files (*zero_pp_rank_*_optim_states.pt; "
            f"zero_optimization.stage={stage}): a stage-0 checkpoint keeps its optimizer in one DeepSpeed object "
            "we do not read. Export the weights with DeepSpeed and load them with from_pretrained"
        )
    optims = [_optimizer_states(p) for p in [optim_files[r] for r in sorted(optim_files)][:1]]
    count = _partition_count(optims[0], optim_files[min(optim_files)])
    paths = _contiguous(optim_files, count, folder, "optim_states")
    optims = [optims[0]] + [_optimizer_states(p) for p in paths[1:]]
    stage = _stage(optims[0], paths[0])
    reader = PieceReader()
    shapes: list[dict[str, list[int]]] = [
        {name: list(shape) for name, shape in group.items()} for group in model["param_shapes"]
    ]
    if stage == 3:
        models = [_model_states(p) for p in _contiguous(stage3_models, count, folder, "model_states")]
        group_of = _stage3_pieces(reader, optims, shapes, paths)
        frozen = _stage3_frozen(reader, models, count)
        files = paths + [stage3_models[r] for r in range(count)]
    else:
        group_of = _stage12_pieces(reader, optims, shapes, paths)
        frozen = whole_frozen_tensors(reader, model, set(group_of))
        files = [folder / MODEL_STATES, *paths]
    buffer_tensors(reader, model)
    param_shapes = {name: shape for group in shapes for name, shape in group.items()} | frozen
    return ForeignCheckpoint(
        folder=folder,
        source=f"DeepSpeed ZeRO-{stage} checkpoint",
        param_shapes=param_shapes,
        trained=[name for group in shapes for name in group],
        reader=reader.finish(),
        global_steps=int(model.get("global_steps") or 0),
        skipped_steps=int(model.get("skipped_steps") or 0),
        param_groups=_param_groups(optims[0], stage),
        group_of=group_of,
        loss_scaler=loss_scaler_state(optims[0].get("loss_scaler")),
        scheduler=model.get("lr_scheduler"),
        client_state={k: v for k, v in model.items() if k not in KNOWN_KEYS},
        files=files,
    )


def _model_states(path: Path) -> dict[str, Any]:
    model = load_foreign(path)
    if not isinstance(model, dict) or "param_shapes" not in model:
        raise ValueError(f"{path} is not a DeepSpeed model-states file (no 'param_shapes'): it is foreign or damaged")
    return model


def _optimizer_states(path: Path) -> dict[str, Any]:
    saved = load_foreign(path)
    states = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
    if not isinstance(states, dict):
        raise ValueError(f"{path} is not a DeepSpeed ZeRO optimizer file (no 'optimizer_state_dict')")
    return states


def _partition_count(states: dict[str, Any], path: Path) -> int:
    count = states.get("partition_count")
    counts = set(count) if isinstance(count, list) else {count}
    if len(counts) != 1 or not all(isinstance(c, int) and c > 0 for c in counts):
        raise ValueError(f"{path}: partition_count={count!r}, expected one positive count for every group")
    return counts.pop()


def _stage(states: dict[str, Any], path: Path) -> int:
    enum = states.get("zero_stage")
    args = getattr(enum, "args", ()) if foreign_name(enum) else ()
    stage = args[0] if args else enum
    if stage not in (1, 2, 3):
        raise ValueError(f"{path}: zero_stage={stage!r}, expected 1, 2 or 3")
    return int(stage)


def _tensor_states(states: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in (states or {}).items() if torch.is_tensor(v)}


def _stage12_state(states: dict[str, Any], group: int) -> dict[str, torch.Tensor]:
    base = states.get("base_optimizer_state")
    if isinstance(base, list):  # elastic_checkpoint: one lean state per group
        found = _tensor_states(base[group])
        step = states.get("base_optimizer_state_step")
        if "step" not in found and step is not None:
            found["step"] = torch.tensor(float(step))
        return found
    return _tensor_states((base or {}).get("state", {}).get(group))


def _stage12_pieces(
    reader: PieceReader, optims: list[dict[str, Any]], shapes: list[dict[str, list[int]]], paths: list[Path]
) -> dict[str, int]:
    group_of: dict[str, int] = {}
    for g, group in enumerate(shapes):
        paddings = (optims[0].get("param_alignment_paddings") or [[]])[g] if shapes else []
        offsets, position = [], 0
        for index, (name, shape) in enumerate(group.items()):
            offsets.append((name, position, math.prod(shape)))
            position += math.prod(shape) + (paddings[index] if index < len(paddings) else 0)
            group_of[name] = g
        for rank, (states, path) in enumerate(zip(optims, paths, strict=True)):
            flat = states["single_partition_of_fp32_groups"][g]
            size = flat.numel() + int(states.get("group_paddings", [0] * len(shapes))[g])
            lo, hi = rank * size, rank * size + flat.numel()
            kinds = {"master": flat, **_stage12_state(states, g)}
            for kind, values in kinds.items():
                if values.ndim == 0:
                    for name, _, _ in offsets:
                        reader.scalars[(name, kind)] = lambda v=values: v
                    continue
                # The last rank's masters drop the group's end padding; its optimizer states keep it.
                if values.numel() not in (flat.numel(), size):
                    raise ValueError(
                        f"{path}: optimizer state {kind!r} of group {g} has {values.numel()} elements, its fp32 "
                        f"partition {flat.numel()} (+{size - flat.numel()} padding): the file is damaged or not "
                        "from DeepSpeed's ZeRO-1/2"
                    )
                for name, start, numel in offsets:
                    s, e = max(start, lo), min(start + numel, hi)
                    reader.add(name, kind, Piece(s - start, e - start, lambda v=values: v, s - lo))
    return group_of


def _stage3_pieces(
    reader: PieceReader, optims: list[dict[str, Any]], shapes: list[dict[str, list[int]]], paths: list[Path]
) -> dict[str, int]:
    count = len(optims)
    group_of: dict[str, int] = {}
    for rank, (states, path) in enumerate(zip(optims, paths, strict=True)):
        flats = states["fp32_flat_groups"]
        inner = states["optimizer_state_dict"]
        if len(flats) != len(shapes):
            raise ValueError(
                f"{path} holds {len(flats)} fp32 sub-groups and the model-states file lists {len(shapes)}: the files "
                "are of different saves"
            )
        sub_group_of = {i: g for g, group in enumerate(inner.get("param_groups", [])) for i in group.get("params", [])}
        for i, group in enumerate(shapes):
            kinds = {"master": flats[i], **_tensor_states(inner.get("state", {}).get(i))}
            position = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                share = math.ceil(numel / count)
                start, end = min(rank * share, numel), min((rank + 1) * share, numel)
                group_of[name] = sub_group_of.get(i, 0)
                for kind, values in kinds.items():
                    if values.ndim == 0:
                        reader.scalars[(name, kind)] = lambda v=values: v
                    elif position + share > values.numel():
                        raise ValueError(
                            f"{path}: sub-group {i}'s {kind!r} has {values.numel()} elements, fewer than its "
                            f"parameters' partitions need: the file is damaged or of another save"
                        )
                    else:
                        reader.add(name, kind, Piece(start, end, lambda v=values: v, position))
                position += share
    return group_of


def _stage3_frozen(reader: PieceReader, models: list[dict[str, Any]], count: int) -> dict[str, list[int]]:
    shapes = {name: list(shape) for name, shape in (models[0].get("frozen_param_shapes") or {}).items()}
    for rank, model in enumerate(models):
        for name, values in (model.get("frozen_param_fragments") or {}).items():
            numel = math.prod(shapes.get(name, [0]))
            share = math.ceil(numel / count)
            start, end = min(rank * share, numel), min((rank + 1) * share, numel)
            reader.add(name, "param", Piece(start, end, lambda v=values: v, 0))
    return {name: shape for name, shape in shapes.items() if (name, "param") in reader.pieces}


def whole_frozen_tensors(reader: PieceReader, model: dict[str, Any], trained: set[str]) -> dict[str, list[int]]:
    """Stages 1-2: the frozen parameters the module's state_dict (or `frozen_param_fragments`) holds whole."""
    module = model.get("module") or {}
    buffers = set(model.get("buffer_names") or [])
    fragments = model.get("frozen_param_fragments") or {}
    frozen: dict[str, list[int]] = {}
    for name, values in {**module, **fragments}.items():
        if name in trained or name in buffers or not torch.is_tensor(values) or values.numel() == 0:
            continue
        if name in (model.get("shared_params") or {}):
            continue  # a tied weight: its values are the parameter it names
        reader.whole[f"{name}/full"] = lambda v=values: v
        frozen[name] = list(values.shape)
    return frozen


def buffer_tensors(reader: PieceReader, model: dict[str, Any]) -> None:
    module = model.get("module") or {}
    for name in model.get("buffer_names") or []:
        if torch.is_tensor(module.get(name)):
            reader.whole[f"{name}/buffer"] = lambda v=module[name]: v


def _param_groups(states: dict[str, Any], stage: int) -> list[dict[str, Any]] | None:
    inner = states.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    return plain_param_groups(inner.get("param_groups")) if isinstance(inner, dict) else None
