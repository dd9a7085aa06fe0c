"""Tensors of a transformers checkpoint folder (model.safetensors, or sharded with an index), read one at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open


class SafetensorsFolder:
    """Looks up tensors by state-dict key across the folder's safetensors files, loading each only when asked."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {key: folder / name for key, name in weight_map.items()}
        elif (folder / "model.safetensors").is_file():
            with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
                self._file_of = {key: folder / "model.safetensors" for key in handle.keys()}
        else:
            raise FileNotFoundError(
                f"{folder} has neither model.safetensors nor model.safetensors.index.json: partitioned loading reads "
                "safetensors checkpoints (save the model with save_pretrained(safe_serialization=True))"
            )
        self._handles: dict[Path, object] = {}

    def keys(self) -> set[str]:
        return set(self._file_of)

    def read_range(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `key`, reading only the rows that hold them."""
        handle = self._handle(key)
        piece = handle.get_slice(key)  # type: ignore[attr-defined]
        shape = piece.get_shape()
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = start // row, -(-end // row)
        rows = piece[first:last] if shape else piece[:]
        return rows.reshape(-1)[start - first * row : end - first * row]

    def _handle(self, key: str) -> object:
        path = self._file_of[key]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def get(self, key: str) -> torch.Tensor:
        path = self._file_of[key]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(key)  # type: ignore[attr-defined]
