"""A checkpoint's `meta.json`: writing it with a checksum of every file, reading it back strictly.

[Note: checkpoint integrity]
Every file of a checkpoint folder is listed in `meta.json` under `files` with its SHA-256, and `meta.json` holds a
SHA-256 of its own other fields (`meta_sha256`, over the sorted-key JSON). Loading and `consolidate` recompute both
before reading a tensor, so a flipped byte, a truncated file, a missing or foreign rank file, or a hand-edited shape
is an error naming the file instead of wrong values. Folders written before checksums existed load with a warning.

[Note: each rank verifies what it reads]
A 70B checkpoint is about 840 GB of fp32 masters and Adam state: one rank hashing all of it takes over 9 minutes of
CPU at ~1.5 GB/s, before any I/O, against a 30-minute process-group timeout. So the set of files (names, sizes,
foreign ones) is checked everywhere, but a loading rank hashes only the rank files it reads (its own ranges, and the
file holding the whole tensors: at the saved world size 1/W to 2/W of the checkpoint), the files in parallel
threads; the ranks then exchange their verdicts (one small all-gather), so a damaged file is refused by every rank,
by name, and none is left waiting in a collective. A file no rank reads is not hashed: nothing is loaded from it.
`consolidate` reads everything and hashes everything.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


FORMAT = "accelerate_zero/1"
META_NAME = "meta.json"
_HASH = "sha256"
_COUNTERS = ("global_steps", "micro_steps", "skipped_steps")


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, read in chunks (hashlib.file_digest)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, _HASH).hexdigest()


def _meta_digest(meta: dict[str, Any]) -> str:
    fields = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def write_meta(folder: Path, meta: dict[str, Any], files: dict[str, str]) -> None:
    """Writes `folder/meta.json` holding `meta`, the checksums `files` (name -> SHA-256) and its own checksum."""
    meta = {**meta, "files": dict(sorted(files.items()))}
    meta["meta_sha256"] = _meta_digest(meta)
    (folder / META_NAME).write_text(json.dumps(meta, indent=1))


def read_meta(folder: Path) -> dict[str, Any]:
    """`folder/meta.json`, checked: it parses, is unedited, and every field has the type it must have.

    Raises:
        FileNotFoundError: there is no meta.json.
        ValueError: naming the file and what is wrong with it.
    """
    path = folder / META_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {folder} is not an accelerate_zero checkpoint folder")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): the file is truncated or corrupted") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: format={found!r}, expected {FORMAT!r}: not an accelerate_zero checkpoint")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_digest(meta):
        raise ValueError(
            f"{path} does not match its own checksum (meta_sha256): it was edited or corrupted after the save; "
            "restore the file or use another checkpoint"
        )
    problems = _field_problems(meta)
    if problems:
        raise ValueError(f"{path} has invalid values: " + "; ".join(problems))
    return meta


def _field_problems(meta: dict[str, Any]) -> list[str]:
    problems = []
    for key in ("stage", "world_size", *_COUNTERS):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"{key}={value!r} (a non-negative integer)")
    if meta.get("stage") not in (0, 1, 2, 3):
        problems.append(f"stage={meta.get('stage')!r} (0, 1, 2 or 3)")
    if meta.get("world_size") == 0:
        problems.append("world_size=0 (at least 1)")
    shapes = meta.get("param_shapes")
    if not isinstance(shapes, dict):
        problems.append(f"param_shapes={type(shapes).__name__} (a mapping of parameter name to shape)")
    else:
        for name, shape in shapes.items():
            if shape is not None and not _is_shape(shape):
                problems.append(f"param_shapes[{name!r}]={shape!r} (a list of non-negative integers)")
    if not isinstance(meta.get("optimizer"), str):
        problems.append(f"optimizer={meta.get('optimizer')!r} (the optimizer's class name)")
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        problems.append("param_groups (a list of mappings)")
    files = meta.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        problems.append("files (a mapping of file name to checksum)")
    return problems


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def verify_files(folder: Path, meta: dict[str, Any]) -> list[Path]:
    """Checks every file `meta.json` lists against its checksum, and that no other rank file is in the folder.

    Returns:
        The rank files, in rank order.

    Raises:
        ValueError: naming the file that is missing, foreign or changed since the save.
    """
    files = check_file_set(folder, meta)
    problems = verify_digests(folder, meta, files)
    if problems:
        raise ValueError(problems[0])
    return files


def check_file_set(folder: Path, meta: dict[str, Any]) -> list[Path]:
    """The rank files, in rank order, after checking the folder holds exactly those `meta.json` lists (no hashing).

    Raises:
        ValueError: naming the file that is missing or foreign.
    """
    listed: dict[str, str] | None = meta.get("files")
    present = sorted(p.name for p in folder.glob("rank*.safetensors"))
    if listed is None:
        warnings.warn(
            f"{folder}/{META_NAME} has no checksums (written by an older accelerate_zero): the files are not verified",
            stacklevel=3,
        )
        expected = [rank_file_name(r) for r in range(1 if meta["stage"] == 0 else meta["world_size"])]
        if present != expected:
            raise ValueError(f"{folder} holds rank files {present}; a stage-{meta['stage']} save writes {expected}")
        return [folder / name for name in present]
    foreign = sorted(set(present) - set(listed))
    if foreign:
        raise ValueError(
            f"{folder} holds rank files the save did not write ({', '.join(foreign)}; the job had "
            f"{meta['world_size']} ranks): they come from another job; delete them or use another checkpoint"
        )
    for name in listed:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (meta.json lists it): copy the whole checkpoint folder")
    return [folder / name for name in sorted(listed) if name.startswith("rank")]


def verify_digests(folder: Path, meta: dict[str, Any], paths: list[Path]) -> list[str]:
    """Hashes `paths` (files `meta.json` lists; in parallel threads: hashlib releases the GIL) and returns a problem
    naming each one that does not match; none without checksums (an older folder, already warned about)."""
    listed: dict[str, str] | None = meta.get("files")
    if listed is None or not paths:
        return []
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_digest, paths))
    return [
        f"{path} does not match its checksum in meta.json: the file is truncated or corrupted "
        f"({path.stat().st_size:,} bytes); restore it or use another checkpoint"
        for path, digest in zip(paths, digests, strict=True)
        if digest != listed[path.name]
    ]
