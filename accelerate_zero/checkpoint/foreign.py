"""What a checkpoint of another framework holds, in our terms: the result of a foreign reader (DeepSpeed's ZeRO and
universal folders) that checkpoint/foreign_load.py restores into an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate_zero.checkpoint.pieces import PieceReader


@dataclass
class ForeignCheckpoint:
    """A foreign checkpoint folder, read ([Note: foreign checkpoints through our fragments] in pieces.py)."""

    folder: Path
    source: str
    """What wrote it, for messages ("DeepSpeed ZeRO-2 checkpoint")."""
    param_shapes: dict[str, list[int]]
    """Every parameter the folder has values for (trained or frozen), by name."""
    trained: list[str]
    """The parameters it holds fp32 masters and optimizer state for (DeepSpeed's `param_shapes`)."""
    reader: PieceReader
    global_steps: int
    skipped_steps: int = 0
    param_groups: list[dict[str, Any]] | None = None
    """The optimizer's hyperparameters per group (no `params`); None when the folder does not hold them."""
    group_of: dict[str, int] = field(default_factory=dict)
    """A trained parameter's optimizer group index."""
    loss_scaler: dict[str, Any] | None = None
    """In the form of engine/loss_scaler.py's `state_dict()`."""
    scheduler: dict[str, Any] | None = None
    """The state_dict of the scheduler the run stepped (DeepSpeed's `{"last_batch_iteration": n}`, or a torch one)."""
    client_state: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    """The files read, for messages."""


def loss_scaler_state(saved: Any) -> dict[str, Any] | None:
    """Our loss scaler's state from DeepSpeed's `LossScaler` / `DynamicLossScaler` (read as a stand-in, [Note:
    reading foreign pickles] in safe_pickle.py); None when there is none."""
    values = vars(saved) if saved is not None and hasattr(saved, "__dict__") else None
    if not values or "cur_scale" not in values:
        return None
    state: dict[str, Any] = {"scale": float(values["cur_scale"])}
    if values.get("dynamic"):
        state["iteration"] = int(values.get("cur_iter", 0))
        state["last_overflow_iteration"] = int(values.get("last_overflow_iter", -1))
        state["hysteresis_left"] = int(values.get("cur_hysteresis", 1))
    return state


def plain_param_groups(groups: Any) -> list[dict[str, Any]] | None:
    """An optimizer state_dict's `param_groups` without `params`, keeping plain values only."""
    if not isinstance(groups, list):
        return None
    plain = (int, float, str, bool, list, tuple, type(None))
    return [{k: v for k, v in group.items() if k != "params" and isinstance(v, plain)} for group in groups]
