"""Reading the torch pickles of other frameworks' checkpoints without running what they name.

[Note: reading foreign pickles]
DeepSpeed's checkpoint files are `torch.save` pickles holding, beside tensors and plain containers, a few objects of
DeepSpeed's own classes (its `LossScaler` / `DynamicLossScaler`, the `ZeroStageEnum` of the stage, the
`fragment_address` of each parameter's slice) and, in Megatron-style runs, an `argparse.Namespace`. Unpickling them
with `weights_only=False` would import DeepSpeed and run whatever a file names (a pickle can call `os.system`). So
they are read with `torch.load(weights_only=True)`, torch's restricted unpickler, with each of those few classes
registered *by name* as an inert stand-in (`ForeignObject`: it only holds the attributes or arguments the pickle
gives it): DeepSpeed is never imported, and any other class is refused, naming the file and the class. A file
that is not a readable torch pickle (truncated, a flipped byte in its zip headers) is refused naming the file.
Tensor data carries no checksum in these files: a changed byte inside a tensor's bytes is not detectable here.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class ForeignObject:
    """An inert stand-in for an object of another framework's class: the attributes (`vars`) or the constructor
    arguments (`args`) its pickle carried, nothing else. `foreign_name` is the class's full name."""

    foreign_name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __repr__(self) -> str:
        return f"<{self.foreign_name} {vars(self)}>"


ALLOWED_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "argparse.Namespace",
)
"""The classes a foreign checkpoint may name, each read as a `ForeignObject` ([Note: reading foreign pickles])."""

_STAND_INS = {
    name: type(name.rsplit(".", 1)[1], (ForeignObject,), {"foreign_name": name, "__module__": __name__})
    for name in ALLOWED_CLASSES
}


def foreign_name(value: Any) -> str | None:
    """The full class name a stand-in was read for; None for anything else."""
    return value.foreign_name if isinstance(value, ForeignObject) else None


def load_foreign(path: Path, mmap: bool = True) -> Any:
    """The object a foreign checkpoint file holds, read with the restricted unpickler; tensors are memory-mapped
    (`mmap`), so a rank pays only for the slices it reads.

    Raises:
        ValueError: the file is missing, unreadable, or names a class outside `ALLOWED_CLASSES` (naming the file,
            and the class).
    """
    if not path.is_file():
        raise ValueError(f"{path} is missing: copy the whole checkpoint folder")
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in _STAND_INS.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise ValueError(_refusal(path, str(error))) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as error:
        raise ValueError(
            f"{path} is not a readable torch checkpoint file ({type(error).__name__}: {str(error).splitlines()[0]}):"
            " it is truncated or corrupted; restore it or use another checkpoint"
        ) from None


def _refusal(path: Path, message: str) -> str:
    lines = [line for line in message.splitlines() if "GLOBAL" in line or "global" in line.lower()]
    named = next((line.strip() for line in lines if "GLOBAL" in line), lines[0].strip() if lines else message[:200])
    return (
        f"{path} holds an object accelerate_zero does not read ({named}): a checkpoint's pickles may only name "
        f"tensors, plain containers and {', '.join(ALLOWED_CLASSES)}. It was not loaded and nothing it names ran; "
        "if the file is yours and you trust it, convert it with its own framework first"
    )
