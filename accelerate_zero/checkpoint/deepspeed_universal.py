"""Reading DeepSpeed's universal checkpoints (`ds_to_universal`) as a `ForeignCheckpoint`, and finding which DeepSpeed
folder a load names.

[Note: DeepSpeed's universal layout]
`ds_to_universal --input_folder <dir>/global_stepN --output_folder <dir>/global_stepN_universal` writes, per trained
parameter, `zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` (a tensor of the parameter's shape, or
`{"param": tensor, "cat_dim": ...}`) and, from stages 1-2, `step.pt`; `zero/optimizer_state.pt` (the optimizer's
`param_groups`, the loss scaler; from stage 3 also the inner optimizer's state, whose `step` we read when there is no
`step.pt`); and a copy of the model-states file(s) (`param_shapes`, `global_steps`, `lr_scheduler`, the module's
buffers). `latest_universal` names the folder. Each file is read when a rank first needs it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from accelerate_zero.checkpoint import deepspeed_read
from accelerate_zero.checkpoint.foreign import ForeignCheckpoint, loss_scaler_state, plain_param_groups
from accelerate_zero.checkpoint.pieces import Piece, PieceReader, cached
from accelerate_zero.checkpoint.safe_pickle import load_foreign


LATEST_UNIVERSAL = "latest_universal"
_ZERO = "zero"
_KINDS = {"fp32": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": "step"}


def is_universal_folder(folder: Path) -> bool:
    return (folder / _ZERO / "optimizer_state.pt").is_file()


def find_deepspeed_folder(load_dir: Path, tag: str | None) -> Path | None:
    """The DeepSpeed tag folder (ZeRO or universal) `load_dir` and `tag` name, or None when they name none: `tag`
    inside `load_dir`; else `load_dir` itself; else what `latest`, or `latest_universal`, names."""
    if tag is not None:
        folder = load_dir / tag
        return folder if _is_deepspeed(folder) else None
    if _is_deepspeed(load_dir):
        return load_dir
    for pointer in ("latest", LATEST_UNIVERSAL):
        path = load_dir / pointer
        if path.is_file():
            try:
                named = path.read_text().strip()
            except (OSError, UnicodeDecodeError):
                return None
            if named and "/" not in named and _is_deepspeed(load_dir / named):
                return load_dir / named
    return None


def _is_deepspeed(folder: Path) -> bool:
    return folder.is_dir() and (deepspeed_read.is_deepspeed_folder(folder) or is_universal_folder(folder))


def read_any(folder: Path) -> ForeignCheckpoint:
    """A DeepSpeed tag folder found by `find_deepspeed_folder`, read as ZeRO partitions or as universal files."""
    return read_universal(folder) if is_universal_folder(folder) else deepspeed_read.read_deepspeed(folder)


def read_universal(folder: Path) -> ForeignCheckpoint:
    """The universal checkpoint in `folder` ([Note: DeepSpeed's universal layout]).

    Raises:
        ValueError: a file is missing, damaged or names a class we do not read (naming it).
    """
    models = sorted(folder.glob("*model_states.pt"))
    if not models:
        raise ValueError(f"{folder} has no *model_states.pt: copy the whole universal checkpoint folder")
    model = load_foreign(models[0])
    optimizer = load_foreign(folder / _ZERO / "optimizer_state.pt")
    if not isinstance(model, dict) or not isinstance(optimizer, dict) or "param_shapes" not in model:
        raise ValueError(f"{folder}: its model-states or zero/optimizer_state.pt file is not DeepSpeed's")
    shapes = {name: list(shape) for group in model["param_shapes"] for name, shape in group.items()}
    reader = PieceReader()
    step = _inner_step(optimizer)
    for name, shape in shapes.items():
        _param_pieces(reader, folder / _ZERO / name, name, math.prod(shape), step)
    frozen = deepspeed_read.whole_frozen_tensors(reader, model, set(shapes))
    deepspeed_read.buffer_tensors(reader, model)
    group_of = {name: g for g, group in enumerate(model["param_shapes"]) for name in group}
    return ForeignCheckpoint(
        folder=folder,
        source="DeepSpeed universal checkpoint",
        param_shapes=shapes | frozen,
        trained=list(shapes),
        reader=reader.finish(),
        global_steps=int(model.get("global_steps") or 0),
        skipped_steps=int(model.get("skipped_steps") or 0),
        param_groups=plain_param_groups(optimizer.get("param_groups")),
        group_of=group_of,
        loss_scaler=loss_scaler_state(optimizer.get("loss_scaler")),
        scheduler=model.get("lr_scheduler"),
        client_state={k: v for k, v in model.items() if k not in deepspeed_read.KNOWN_KEYS},
        files=[*models, folder / _ZERO / "optimizer_state.pt"],
    )


def _param_pieces(reader: PieceReader, where: Path, name: str, numel: int, step: torch.Tensor | None) -> None:
    if not (where / "fp32.pt").is_file():
        raise ValueError(f"{where / 'fp32.pt'} is missing (the model-states file lists {name}): copy the whole folder")
    for stem, kind in _KINDS.items():
        path = where / f"{stem}.pt"
        if not path.is_file():
            continue
        values = cached(lambda path=path: _tensor(path))
        if kind == "step":
            reader.scalars[(name, kind)] = values
        else:
            reader.add(name, kind, Piece(0, numel, values))
    if not (where / "step.pt").is_file() and step is not None:
        reader.scalars[(name, "step")] = lambda: step


def _tensor(path: Path) -> torch.Tensor:
    saved = load_foreign(path)
    values = saved.get("param") if isinstance(saved, dict) else saved
    if not torch.is_tensor(values):
        raise ValueError(
            f"{path} holds no tensor (a {type(saved).__name__}): it is damaged or not from ds_to_universal"
        )
    return values


def _inner_step(optimizer: dict[str, Any]) -> torch.Tensor | None:
    inner = optimizer.get("optimizer_state_dict")
    states = inner.get("state", {}) if isinstance(inner, dict) else {}
    for state in states.values():
        if isinstance(state, dict) and torch.is_tensor(state.get("step")):
            return state["step"]
    return None
