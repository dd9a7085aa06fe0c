"""Checkpoint folders that are never half-written, and lazy reading of fragments from every rank's file.

All ranks write into `<save_dir>/.<tag>.partial`; once every rank is done, rank 0 renames it to `<tag>` (an
older `<tag>` is moved aside first and deleted after) and then rewrites `latest`. A job killed during a save
leaves the previous checkpoint and `latest` as they were. Ranks must share the file system holding `save_dir`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from accelerate_zero.checkpoint.fragments import parse_key


def partial_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.partial"


def publish_dir(save_dir: Path, tag: str, barrier: Callable[[], None], is_main: bool) -> Path:
    """Makes the partial folder the checkpoint `tag`; call on every rank after its files are written."""
    barrier()
    final = save_dir / tag
    if is_main:
        old = save_dir / f".{tag}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial_dir(save_dir, tag), final)
        shutil.rmtree(old, ignore_errors=True)
        latest_tmp = save_dir / ".latest.partial"
        latest_tmp.write_text(tag)
        os.replace(latest_tmp, save_dir / "latest")
    barrier()
    return final


def resolve_tag(load_dir: Path, tag: str | None) -> Path:
    if tag is None:
        latest = load_dir / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"no 'latest' file in {load_dir}: pass tag=... or check the path")
        tag = latest.read_text().strip()
    folder = load_dir / tag
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    return folder


class FragmentReader:
    """Reads any element range of a saved parameter, from whichever rank files hold its pieces."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = [safe_open(str(path), framework="pt") for path in files]
        self.pieces: dict[tuple[str, str], list[tuple[int, int, int, str]]] = {}
        self.whole: dict[str, tuple[int, str]] = {}
        for index, handle in enumerate(self._handles):
            for key in handle.keys():
                parsed = parse_key(key)
                if parsed is None:
                    self.whole[key] = (index, key)
                else:
                    name, start, end, kind = parsed
                    self.pieces.setdefault((name, kind), []).append((start, end, index, key))
        for pieces in self.pieces.values():
            pieces.sort()

    def kinds_of(self, name: str) -> set[str]:
        return {kind for (n, kind) in self.pieces if n == name}

    def read_range(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        """Elements [start, end) of `name`'s saved `kind`; None when nothing was saved for it."""
        pieces = self.pieces.get((name, kind))
        if not pieces:
            return None
        parts, position = [], start
        for piece_start, piece_end, index, key in pieces:
            if piece_end <= position or piece_start >= end:
                continue
            if piece_start > position:
                break
            stop = min(end, piece_end)
            parts.append(self._handles[index].get_slice(key)[position - piece_start : stop - piece_start])
            position = stop
            if position == end:
                break
        if position != end:
            raise ValueError(f"checkpoint has no {kind} values for {name}[{position}:{end}]: is a rank file missing?")
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def read_scalar(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        for piece_start, piece_end, index, key in self.pieces.get((name, kind), []):
            if piece_start < end and piece_end > start:
                return self._handles[index].get_tensor(key)
        return None

    def read_whole(self, key: str) -> torch.Tensor | None:
        found = self.whole.get(key)
        return None if found is None else self._handles[found[0]].get_tensor(found[1])
