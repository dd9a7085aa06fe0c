"""The folders accelerate's FSDP `save_state` (FSDP2, and FSDP1 with `SHARDED_STATE_DICT`) and the transformers FSDP
Trainer's `checkpoint-N` write, found from what a load names.

[Note: accelerate's FSDP folders]
With `SHARDED_STATE_DICT` (accelerate's default), `save_state(dir)` writes the i-th model as a DCP folder
`dir/pytorch_model_fsdp_<i>/` holding `{"model": state_dict}` (keys `model.<name>`) and its optimizer as
`dir/optimizer_<i>/` holding `{"optimizer": optim_state_dict}` (keys `optimizer.state.<name>.<state>`,
`optimizer.param_groups.<g>.<hyperparameter>`), beside `scheduler.bin`, `random_states_<rank>.pkl`, the samplers
and `custom_checkpoint_<k>.pkl`; the transformers Trainer writes the same two folders into `checkpoint-N/` beside its
own files. A load may name the save folder, either DCP folder, or the pair by tag (`pytorch_model_fsdp_<i>`): the
model folder and its optimizer folder are read together (checkpoint/dcp_load.py).
With `FULL_STATE_DICT` (the transformers 5 Trainer's default for FSDP) rank 0 writes instead
`pytorch_model_fsdp[_<i>].bin`, the full model state_dict, and `optimizer[_<i>].bin`, the full optimizer state_dict
keyed by parameter name (`{"state": {name: {"exp_avg": ..., "step": ...}}, "param_groups": [{..., "params": [names]}]}`):
plain tensors and containers, read with `torch.load(weights_only=True)` (memory-mapped) as a `ForeignCheckpoint`
([Note: foreign checkpoints through our fragments] in pieces.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from accelerate_zero.checkpoint.foreign import ForeignCheckpoint, plain_param_groups
from accelerate_zero.checkpoint.pieces import Piece, PieceReader
from accelerate_zero.checkpoint.safe_pickle import load_foreign


_MODEL = re.compile(r"^pytorch_model_fsdp_(\d+)$")
_OPTIMIZER = re.compile(r"^optimizer_(\d+)$")


def model_dir(index: int) -> str:
    return f"pytorch_model_fsdp_{index}"


def optimizer_dir(index: int) -> str:
    return f"optimizer_{index}"


def _dcp(folder: Path) -> bool:
    return (folder / ".metadata").is_file()


def fsdp_folders(load_dir: Path, tag: str | None) -> tuple[Path, Path] | None:
    """(the model's DCP folder, its optimizer's DCP folder, which may not exist) that `load_dir` and `tag` name
    ([Note: accelerate's FSDP folders]); None when they name no accelerate FSDP `SHARDED_STATE_DICT` folder."""
    if tag is not None:
        match = _MODEL.match(tag)
        return (load_dir / tag, load_dir / optimizer_dir(int(match[1]))) if match and _dcp(load_dir / tag) else None
    if _dcp(load_dir / model_dir(0)):
        return load_dir / model_dir(0), load_dir / optimizer_dir(0)
    own = _MODEL.match(load_dir.name)
    if own and _dcp(load_dir) and _dcp(load_dir.parent / optimizer_dir(int(own[1]))):
        return load_dir, load_dir.parent / optimizer_dir(int(own[1]))
    own = _OPTIMIZER.match(load_dir.name)
    if own and _dcp(load_dir) and _dcp(load_dir.parent / model_dir(int(own[1]))):
        return load_dir.parent / model_dir(int(own[1])), load_dir
    return None


def missing_optimizer(model: Path, optimizer: Path) -> str:
    """The message for an FSDP save whose optimizer state is missing."""
    return (
        f"{model.parent} is an accelerate FSDP save whose optimizer state {optimizer.name} is missing ({model.name} "
        "holds the model only): copy the whole save folder, or pass load_optimizer_states=False to load the weights "
        "only"
    )


def full_state_files(load_dir: Path, tag: str | None) -> tuple[Path, Path] | None:
    """(`pytorch_model_fsdp[_<i>].bin`, `optimizer[_<i>].bin`) of a `FULL_STATE_DICT` save in `load_dir` (`tag`:
    `pytorch_model_fsdp_<i>`; None: the first model's); None when there is no such model file."""
    index = 0
    if tag is not None:
        match = _MODEL.match(tag)
        if match is None:
            return None
        index = int(match[1])
    suffix = "" if index == 0 else f"_{index}"
    model = load_dir / f"pytorch_model_fsdp{suffix}.bin"
    return (model, load_dir / f"optimizer{suffix}.bin") if model.is_file() else None


def read_full_state(model_file: Path, optimizer_file: Path | None) -> ForeignCheckpoint:
    """A `FULL_STATE_DICT` save ([Note: accelerate's FSDP folders]); `optimizer_file` None: the weights only.

    Raises:
        ValueError: a file is missing, damaged or holds something else than a state_dict (naming it).
    """
    weights = load_foreign(model_file)
    if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
        raise ValueError(f"{model_file} is not a model state_dict (a mapping of names to tensors)")
    reader = PieceReader()
    for name, values in weights.items():
        reader.whole[f"{name}/full"] = reader.whole[f"{name}/buffer"] = lambda v=values: v
    saved = load_foreign(optimizer_file) if optimizer_file is not None else {"state": {}, "param_groups": None}
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise ValueError(f"{optimizer_file} is not an optimizer state_dict keyed by parameter name (no 'state')")
    states: dict[str, dict[str, Any]] = saved["state"]
    for name, state in states.items():
        if name not in weights:
            raise ValueError(f"{optimizer_file} holds state for {name!r}, which {model_file.name} does not hold")
        reader.add(name, "master", Piece(0, weights[name].numel(), lambda v=weights[name]: v))
        for kind, values in state.items():
            if torch.is_tensor(values) and values.ndim == 0:
                reader.scalars[(name, kind)] = lambda v=values: v
            elif torch.is_tensor(values):
                reader.add(name, kind, Piece(0, values.numel(), lambda v=values: v))
    groups = saved.get("param_groups") or []
    steps = [float(s["step"]) for s in states.values() if torch.is_tensor(s.get("step"))]
    return ForeignCheckpoint(
        folder=model_file.parent,
        source="accelerate FSDP FULL_STATE_DICT checkpoint",
        param_shapes={name: list(values.shape) for name, values in weights.items()},
        trained=list(states),
        reader=reader.finish(),
        global_steps=int(max(steps, default=0)),
        param_groups=plain_param_groups(groups) if groups else None,
        group_of={name: g for g, group in enumerate(groups) for name in group.get("params", [])},
        files=[model_file] + ([optimizer_file] if optimizer_file is not None else []),
    )
