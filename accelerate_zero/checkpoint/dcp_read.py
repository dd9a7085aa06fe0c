"""Reading a `torch.distributed.checkpoint` (DCP) folder without unpickling anything but its own metadata types.

[Note: reading DCP folders safely]
A DCP folder (written by FSDP2 or torchtitan with `dcp.save`) holds `.metadata`, a pickle of DCP's `Metadata`
(every key's shape and dtype, and which byte range of which `__<rank>_<n>.distcp` file holds each chunk), and the
data files. torch's `FileSystemReader.read_metadata` unpickles it with `pickle.load`, which runs whatever the file
names; `DefaultLoadPlanner.load_bytes` loads non-tensor values with `torch.load(weights_only=False)`. Here the
metadata is read by an unpickler that builds only DCP's metadata dataclasses, torch sizes and dtypes and plain
containers; tensors are read by DCP itself (`torch.load(weights_only=True)`), and non-tensor values (optimizer
hyperparameters, scheduler fields) from their byte range with `torch.load(weights_only=True)`. Before anything is
read, every data file the metadata names must exist and hold the byte ranges it lists: a folder missing a rank's
file is refused naming it.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata


METADATA_NAME = ".metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout (torch.strided)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


def is_dcp_folder(folder: Path) -> bool:
    """Whether `folder` is a DCP checkpoint (it holds `.metadata`)."""
    return (folder / METADATA_NAME).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if (module, name) in _ALLOWED:
            return True
        if module == "torch.distributed.checkpoint.metadata":  # its dataclasses and enums
            return isinstance(getattr(dcp_metadata, name, None), type)
        return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata(folder: Path) -> Metadata:
    """DCP's `Metadata` of `folder`, unpickled with DCP's own types only.

    Raises:
        ValueError: the file is not DCP metadata (naming it and the type it tried to build).
    """
    path = folder / METADATA_NAME
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as error:
        raise ValueError(
            f"{path} is not a DCP metadata file ({error}): it is corrupted or not from dcp.save"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with its metadata read by `read_metadata` ([Note: reading DCP folders safely])."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(Path(self.path))


def check_data_files(folder: Path, metadata: Metadata) -> None:
    """Every data file `metadata` names exists and is long enough for every byte range it lists.

    Raises:
        ValueError: naming the missing or truncated file (a rank's file of a partial copy).
    """
    ends: dict[str, int] = collections.defaultdict(int)
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends[info.relative_path], info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(
                f"{path} is missing ({folder}/.metadata lists data in it): the DCP checkpoint was copied partially; "
                "copy every __<rank>_<n>.distcp file"
            )
        if path.stat().st_size < end:
            raise ValueError(f"{path} is truncated ({path.stat().st_size:,} bytes, the metadata needs {end:,})")


def tensor_shapes(metadata: Metadata) -> dict[str, list[int]]:
    return {
        key: list(value.size)
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata)
    }


def load_tensors(folder: Path, wanted: dict[str, torch.Tensor], metadata: Metadata | None = None) -> None:
    """Fills the tensors of `wanted` (full-size, on the CPU) from the folder; no collective (every rank reads what it
    needs).

    Raises:
        ValueError: a data file cannot be read (naming the files the keys are in, when `metadata` is given).
    """
    if not wanted:
        return
    try:
        dcp.load(
            wanted,
            storage_reader=SafeReader(str(folder)),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    except Exception as error:  # DCP raises its readers' errors wrapped (CheckpointException), any type inside
        files = sorted(
            {info.relative_path for index, info in (metadata.storage_data or {}).items() if index.fqn in wanted}
            if metadata is not None
            else set()
        )
        where = ", ".join(str(folder / name) for name in files) or str(folder)
        first = str(error).strip().splitlines()
        raise ValueError(
            f"reading {len(wanted)} tensors ({next(iter(wanted))}, ...) from {where} failed "
            f"({type(error).__name__}: {first[0][:300] if first else ''}): the file is damaged or truncated; "
            "restore it or use another checkpoint"
        ) from None


def load_value(folder: Path, metadata: Metadata, key: str) -> Any:
    """A non-tensor value (a hyperparameter, a scheduler field) by its key, or None when the folder has none;
    read with `torch.load(weights_only=True)`."""
    if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
        return None
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
    with open(folder / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        data = handle.read(info.length)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # a damaged byte: any unpickling or zip error
        raise ValueError(
            f"{folder / info.relative_path}: the value of {key} (bytes {info.offset}-{info.offset + info.length}) "
            f"cannot be read ({type(error).__name__}): the file is damaged or truncated; restore it or use another "
            "checkpoint"
        ) from None
