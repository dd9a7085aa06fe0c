"""A `save_pretrained`-style sharded safetensors export written by every rank in parallel.

[Note: parallel Hugging Face export]
The 16-bit save gathers the whole model onto rank 0, which writes it: rank 0's host memory holds the model. Here the
files are planned first from the engine's meta state dict (keys, shapes, dtypes: no gather), each at most
`max_shard_bytes` (as `save_pretrained` splits them), and file i is written by rank i % W. The parameters are then
streamed full, one stage-3 unit at a time (`named_full_parameters`; every rank takes part in every gather), and each
rank keeps only the tensors of its files. The files follow the order the stream yields the tensors in (units in
order, then the parameters no unit holds, then the buffers), so a file is complete, and written, as soon as its last
tensor arrives: no rank holds more than the file it is filling plus the unit in flight (in state-dict order a file
waited for the small persistent parameters the stream yields last: measured, half the model per rank). Rank 0 writes `model.safetensors.index.json` last, once
every rank's files are in place. A tied parameter is written once, under its first name, as `save_pretrained` does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from accelerate_zero.engine import collectives


INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30


def plan_files(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys (in order) grouped into files of at most `max_shard_bytes` (a larger tensor gets a file of its own)."""
    files: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if files[-1] and used + size > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(key)
        used += size
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def save_pretrained_parallel(
    engine: Any, folder: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: torch.dtype | None = None
) -> list[str]:
    """Writes the model's weights as sharded safetensors with an index, each rank its share of the files
    ([Note: parallel Hugging Face export]); every rank must call it. `from_pretrained` loads the folder (write the
    config beside it with `model.config.save_pretrained`).

    Args:
        engine: a ZeroEngine.
        folder: where the files go (created).
        max_shard_bytes: the most bytes of one file (save_pretrained's `max_shard_size`).
        dtype: of the floating-point tensors written; None: the engine's compute dtype.

    Returns:
        The names of the files this rank wrote.
    """
    if getattr(engine, "experts", None) is not None:
        raise NotImplementedError(
            "save_pretrained_parallel with expert_parallel: split experts are written whole from rank 0; use "
            "engine.save_16bit_model or the Trainer's save_model (they gather the experts)"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    world = engine.layout.world
    dtype = dtype or engine.compute_dtype
    kept = {name for name, _ in engine.module.named_parameters()}
    aliases = {name for name, _ in engine.module.named_parameters(remove_duplicate=False)} - kept
    meta = {k: v for k, v in engine.meta_state_dict().items() if k not in aliases}
    out_dtype = {k: dtype if v.is_floating_point() else v.dtype for k, v in meta.items()}
    sizes = {k: math.prod(meta[k].shape) * out_dtype[k].itemsize for k in _stream_order(engine, meta)}
    files = plan_files(sizes, max_shard_bytes)
    names = file_names(len(files))
    mine = {key: index for index, keys in enumerate(files) if index % world.world_size == world.rank for key in keys}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    written: list[str] = []

    def take(key: str, tensor: torch.Tensor) -> None:
        index = mine.get(key)
        if index is None:
            return
        pending.setdefault(index, {})[key] = tensor.detach().to("cpu", out_dtype[key]).contiguous()
        if len(pending[index]) == len(files[index]):
            _write(folder, names[index], pending.pop(index))
            written.append(names[index])

    for name, tensor in engine.named_full_parameters(dtype=dtype, merge_lora=False):
        if name in meta:
            take(name, tensor)
    for name, buffer in engine.module.named_buffers():
        if name in meta:  # persistent buffers: held whole on every rank
            take(name, buffer)
    if pending:
        missing = sorted(key for index, got in pending.items() for key in files[index] if key not in got)
        raise RuntimeError(f"rank {world.rank}: the weights stream never yielded {missing[:5]}: files left unwritten")
    collectives.barrier(world)
    if world.rank == 0 and len(files) > 1:
        weight_map = {key: names[index] for index, keys in enumerate(files) for key in keys}
        index_file = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        partial = folder / f".{INDEX_NAME}.partial"
        partial.write_text(json.dumps(index_file, indent=2, sort_keys=True))
        partial.replace(folder / INDEX_NAME)
    collectives.barrier(world)
    return written


def _stream_order(engine: Any, meta: dict[str, torch.Tensor]) -> list[str]:
    """The keys of `meta` in the order the weights stream yields them: stage-3 units in order, then the parameters
    no unit holds, then the buffers (engine/full_weights.py)."""
    names: dict[int, str] = {}
    for name, param in engine.module.named_parameters():
        names.setdefault(id(param), name)
    order = [names[id(p)] for group in engine.gather_groups() for p in group if id(p) in names]
    order += [name for name, _ in engine.module.named_parameters()]
    order += list(meta)
    return [key for key in dict.fromkeys(order) if key in meta]


def _write(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    partial = folder / f".{name}.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    partial.replace(folder / name)  # never a half-written weights file
