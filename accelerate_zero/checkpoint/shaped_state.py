"""How optimizer state is saved and found again when it is not one value per element.

[Note: state in a parameter's own shape]
Elementwise state (one value per element: AdamW's moments, Muon's momentum) is saved flattened, one piece per
fragment, so any layout at any world size reads any range of it back; a scalar (`step`) is saved once per fragment.
An optimizer that steps whole parameters (engine/owned_step.py) may keep state of other shapes: Adafactor's row and
column moments, bitsandbytes' quantile maps and block maxima. The parameter's owner saves such a tensor as it is,
under the whole parameter's fragment key (`name@0:numel/kind`), and a loading owner takes it whole, at any world
size. A flat range cannot take a piece of it (it is not a function of the elements): refused by name, as is a flat
range whose state is neither elementwise nor scalar (saving it would drop it silently).
"""

from __future__ import annotations

from typing import Any

import torch

from accelerate_zero.checkpoint.fragments import Fragment
from accelerate_zero.checkpoint.io import FragmentReader


def saved_state(value: torch.Tensor, piece: slice, numel: int, whole: bool, frag: Fragment, kind: str) -> torch.Tensor:
    """What a checkpoint stores of optimizer state `value` for the fragment `piece` of a range of `numel` elements;
    `whole`: the range is a whole parameter stepped in its own shape.

    Raises:
        ValueError: a flat range with state that is neither elementwise nor a scalar (named).
    """
    if value.numel() == numel and value.ndim > 0:
        return value.reshape(-1)[piece]
    if whole and value.ndim > 0:
        return value
    if value.numel() == 1:
        return value.reshape(())
    raise ValueError(
        f"optimizer state {kind!r} of {frag.name} has shape {tuple(value.shape)}, neither one value per element of "
        f"the slice ({numel}) nor a scalar: this optimizer is not elementwise; drop its zero_elementwise declaration "
        "so that it steps whole parameters (optim/kinds.py)"
    )


def shaped_state(reader: Any, frag: Fragment, kind: str, whole: bool) -> torch.Tensor | None:
    """The saved `kind` of `frag`'s parameter when it was saved whole in a shape of its own; None when it is
    elementwise (read it range by range) or absent.

    Raises:
        ValueError: it was saved in a shape of its own and the loading range is not a whole parameter.
    """
    if not isinstance(reader, FragmentReader):  # only our own rank files keep such state; a foreign one's is
        return None  # elementwise (Adam's moments) or scalar
    for start, end, _, _ in reader.pieces.get((frag.name, kind), []):
        if start != 0 or end < frag.end:
            continue
        saved = reader.read_scalar(frag.name, kind, start, end)
        if saved is None or saved.ndim == 0 or tuple(saved.shape) == (end - start,):
            continue
        if not whole:
            raise ValueError(
                f"the checkpoint holds optimizer state {kind!r} of {frag.name} in a shape of its own "
                f"{tuple(saved.shape)} (saved by an optimizer stepping whole parameters), which flat shards cannot "
                "take a piece of: load with the same optimizer, or pass load_optimizer_states=False"
            )
        return saved
    return None
