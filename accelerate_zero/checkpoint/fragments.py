"""Which element ranges of which named parameters a rank's tensors hold (pure; no I/O, no communication).

[Note: universal checkpoints]
A rank saves, for every parameter element range it owns, the fp32 master values and the optimizer state of that
range, keyed by parameter name and range. Loading assembles whatever ranges the loading rank owns from whichever
saved ranks held them, so a checkpoint loads on any world size and any stage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from accelerate_zero.engine.shard_plan import BucketPlan


@dataclass(frozen=True)
class Fragment:
    """Elements [start, end) of the flattened parameter `name`, found at `offset` in the holding tensor."""

    name: str
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def key(self, kind: str) -> str:
        return f"{self.name}@{self.start}:{self.end}/{kind}"


_KEY = re.compile(r"^(?P<name>.+)@(?P<start>\d+):(?P<end>\d+)/(?P<kind>[\w.]+)$")


def parse_key(key: str) -> tuple[str, int, int, str] | None:
    """(name, start, end, kind) of a fragment key, or None for a whole-tensor key."""
    match = _KEY.match(key)
    if match is None:
        return None
    return match["name"], int(match["start"]), int(match["end"]), match["kind"]


def whole_key(name: str, kind: str) -> str:
    return f"{name}/{kind}"


def range_fragments(
    plan: BucketPlan,
    params: list[torch.nn.Parameter],
    names: dict[int, str],
    lo: int,
    hi: int,
    whole_offsets: dict[int, int] | None = None,
) -> list[Fragment]:
    """The parameter pieces inside [lo, hi) of a bucket; offsets are relative to `lo`. `whole_offsets`: id(param)
    -> where a parameter holding part of a whole tensor starts in it (fragments name ranges of the whole tensor)."""
    fragments = []
    for slot in plan.slots:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end:
            param = params[slot.param_index]
            name, shift = names[id(param)], (whole_offsets or {}).get(id(param), 0)
            fragments.append(Fragment(name, start - slot.offset + shift, end - slot.offset + shift, start - lo))
    return sorted(fragments, key=lambda f: f.offset)


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers `state_dict` holds, by name: what a checkpoint saves whole beside the parameters' ranges.
    Non-persistent ones (rotary `inv_freq`) are rebuilt by the model itself, and `save_pretrained` never writes
    them."""
    out = []
    for prefix, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out
