"""Another framework's checkpoint seen as ours: element ranges of named parameters, read lazily.

[Note: foreign checkpoints through our fragments]
Our own loading assembles each rank's ranges of every parameter from whichever saved ranks held them
([Note: universal checkpoints] in fragments.py), through a reader answering "elements [start, end) of parameter
`name`'s `kind`" (`master`, an optimizer state, `param`), "the whole tensor `key`" and "the scalar `kind` of `name`".
A DeepSpeed folder (its ZeRO partitions, or its universal per-parameter files) answers the same questions once its
layout is known: `PieceReader` holds, per (name, kind), the pieces (element range, where the values are) a foreign
reader found, and the load of our own format runs unchanged on top (checkpoint/fragment_load.py). Values are 1-D
slices of memory-mapped tensors, or read from a file on first use, so a rank reads only the bytes its ranges need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


Values = Callable[[], torch.Tensor]
"""Returns a piece's values as a 1-D tensor (read from its file on the first call)."""


@dataclass
class Piece:
    """Elements [start, end) of a parameter, found at [offset, offset + end - start) of `values()` (flattened)."""

    start: int
    end: int
    values: Values
    offset: int = 0


@dataclass
class PieceReader:
    """Reads element ranges of named parameters from the pieces a foreign checkpoint holds; the reading interface of
    checkpoint/io.py's `FragmentReader`."""

    pieces: dict[tuple[str, str], list[Piece]] = field(default_factory=dict)
    whole: dict[str, Values] = field(default_factory=dict)
    """`<name>/full` (a parameter held whole), `<name>/buffer` (a persistent buffer)."""
    scalars: dict[tuple[str, str], Values] = field(default_factory=dict)
    """(name, kind) -> a 0-d optimizer state (`step`)."""

    def add(self, name: str, kind: str, piece: Piece) -> None:
        if piece.end > piece.start:
            self.pieces.setdefault((name, kind), []).append(piece)

    def finish(self) -> PieceReader:
        for pieces in self.pieces.values():
            pieces.sort(key=lambda piece: piece.start)
        return self

    def kinds_of(self, name: str) -> set[str]:
        return {kind for (n, kind) in self.pieces if n == name} | {kind for (n, kind) in self.scalars if n == name}

    def names(self, kind: str) -> set[str]:
        return {name for (name, k) in self.pieces if k == kind}

    def read_range(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        """Elements [start, end) of `name`'s `kind`; None when nothing was saved for it.

        Raises:
            ValueError: some of the range is in no piece (a partition file the folder lacks).
        """
        pieces = self.pieces.get((name, kind))
        if not pieces:
            return None
        parts, position = [], start
        for piece in pieces:
            if piece.end <= position or piece.start >= end:
                continue
            if piece.start > position:
                break
            stop = min(end, piece.end)
            lo = piece.offset + position - piece.start
            parts.append(piece.values().reshape(-1)[lo : lo + stop - position])
            position = stop
            if position == end:
                break
        if position != end:
            raise ValueError(f"the checkpoint has no {kind} values for {name}[{position}:{end}]: is a file missing?")
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def read_scalar(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        found = self.scalars.get((name, kind))
        return None if found is None else found().reshape(())

    def read_whole(self, key: str) -> torch.Tensor | None:
        found = self.whole.get(key)
        return None if found is None else found()


def cached(load: Callable[[], Any]) -> Callable[[], Any]:
    """`load`, called once: a file several pieces slice is read (or memory-mapped) one time."""
    box: list[Any] = []

    def get() -> Any:
        if not box:
            box.append(load())
        return box[0]

    return get
