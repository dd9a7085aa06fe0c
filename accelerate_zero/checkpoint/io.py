"""Checkpoint folders that are never half-written, and lazy reading of fragments from every rank's file.

All ranks write into `<save_dir>/.<tag>.partial`, which rank 0 empties first (files of a killed save, maybe of a
job with more ranks, are never published). Once every rank is done, rank 0 renames it to `<tag>` and then
rewrites `latest` (written aside, then renamed over). A save killed at any point leaves `latest` naming a complete
checkpoint: when `<tag>` already exists (re-saving a fixed tag), a hard-linked copy `.<tag>.old` of it is made
first and `latest` names that copy while `<tag>` is swapped. The next successful save removes leftovers of killed
saves. Ranks must share the file system holding `save_dir`.

[Note: a checkpoint folder only some ranks see]
On several nodes a `save_dir` on a node-local disk exists on every node under the same name, but what rank 0
creates there only its own node sees: the other nodes' ranks would write into folders nobody publishes, or fail
alone while the others wait at the next barrier until the process-group timeout. So before any shard is written
rank 0 leaves a random token in the partial folder, every rank reads it back, and the answers are exchanged: a
rank that read nothing or another token (a stale folder of its own disk) makes every rank raise, naming the ranks
and nodes and the folder, with nothing written.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from accelerate_zero.checkpoint.fragments import parse_key


LATEST = "latest"
_LEFTOVER_SUFFIXES = (".partial", ".old", ".trash")


def partial_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.partial"


def fresh_partial_dir(save_dir: Path, tag: str) -> Path:
    """An empty `.<tag>.partial` (rank 0 only; the other ranks wait for it at a barrier)."""
    work = partial_dir(save_dir, tag)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


SHARED_MARKER = ".shared_by_every_rank"


def check_shared_folder(
    work: Path,
    is_main: bool,
    barrier: Callable[[], None],
    exchange: Callable[[object], list],
    node_of: Callable[[int], int],
) -> None:
    """[Note: a checkpoint folder only some ranks see]; every rank must call it after `fresh_partial_dir`.
    `exchange`: every rank's object, in rank order (an all-gather); `node_of`: a rank's node.

    Raises:
        OSError: some ranks do not see rank 0's partial folder (on every rank).
    """
    marker = work / SHARED_MARKER
    token = secrets.token_hex(8) if is_main else None
    if is_main:
        marker.write_text(token)
    barrier()
    seen = marker.read_text() if marker.is_file() else None
    answers = exchange((token, seen))
    expected = answers[0][0]
    blind = [rank for rank, (_, saw) in enumerate(answers) if saw != expected]
    barrier()  # every rank has read the marker
    if is_main:
        marker.unlink()
    if blind:
        nodes = sorted({node_of(rank) for rank in blind})
        raise OSError(
            f"checkpoint folder {work.parent} is not shared by every rank: ranks {blind} (node(s) {nodes}) do not see "
            f"what rank 0 wrote in {work.name}; it is on a node-local disk. Save to a file system every node mounts "
            "(nothing was written)"
        )


def publish_dir(save_dir: Path, tag: str, barrier: Callable[[], None], is_main: bool) -> Path:
    """Makes the partial folder the checkpoint `tag`; call on every rank after its files are written."""
    barrier()
    final = save_dir / tag
    if is_main:
        if final.exists():
            _replace_existing(save_dir, tag)
        else:
            os.replace(partial_dir(save_dir, tag), final)
            write_latest(save_dir, tag)
        _remove_leftovers(save_dir)
    barrier()
    return final


def _replace_existing(save_dir: Path, tag: str) -> None:
    final, keep, trash = save_dir / tag, save_dir / f".{tag}.old", save_dir / f".{tag}.trash"
    names_tag = _read_latest(save_dir) == tag
    if names_tag:
        # `latest` must name a complete folder while `tag` is swapped: a hard-linked copy costs no data copy.
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(final, keep, copy_function=_link_or_copy)
        write_latest(save_dir, keep.name)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(final, trash)
    os.replace(partial_dir(save_dir, tag), final)
    write_latest(save_dir, tag)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copy2(source, target)


def write_latest(save_dir: Path, tag: str) -> None:
    latest_tmp = save_dir / ".latest.partial"
    latest_tmp.write_text(tag)
    os.replace(latest_tmp, save_dir / LATEST)


def _read_latest(save_dir: Path) -> str | None:
    try:
        return (save_dir / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _remove_leftovers(save_dir: Path) -> None:
    """Folders of saves that were killed (`.<tag>.partial`, `.<tag>.old`, `.<tag>.trash`), except what `latest`
    names."""
    latest = _read_latest(save_dir)
    for child in save_dir.iterdir():
        if child.name.startswith(".") and child.name.endswith(_LEFTOVER_SUFFIXES) and child.name != latest:
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


def check_tag(tag: str, source: str) -> str:
    """`tag` if it names a folder directly inside the checkpoint folder; a ValueError otherwise."""
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or os.path.isabs(tag) or "\0" in tag:
        raise ValueError(
            f"{source}: tag {tag!r} is not a folder name inside the checkpoint folder (no '/', '..' or absolute "
            "paths); pass the tag of a checkpoint saved there"
        )
    return tag


def resolve_tag(load_dir: Path, tag: str | None) -> Path:
    """The checkpoint folder `load_dir/<tag>` (`tag` None: the one `latest` names).

    Raises:
        FileNotFoundError: no `latest`, or the folder does not exist.
        ValueError: the tag would leave `load_dir` (`../x`, an absolute path) or `latest` is not text.
    """
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            raise FileNotFoundError(f"no 'latest' file in {load_dir}: pass tag=... or check the path")
        try:
            tag = latest.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{latest} is not a text file naming a checkpoint: pass tag=... or fix it") from None
        check_tag(tag, str(latest))
    else:
        check_tag(tag, "tag")
    folder = load_dir / tag
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    return folder


def _open(path: Path) -> object:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}): it is truncated or corrupted"
        ) from None


class FragmentReader:
    """Reads any element range of a saved parameter, from whichever rank files hold its pieces."""

    def __init__(self, files: list[Path]) -> None:
        self.paths = list(files)
        self._handles = [_open(path) for path in files]
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

    def files_for(self, ranges: Iterable[tuple[str, int, int]], whole: Iterable[str]) -> list[Path]:
        """The files holding a saved piece (of any kind) of one of `ranges` ((name, start, end) element ranges) or
        one of the `whole` keys: every file reading them can touch ([Note: each rank verifies what it reads])."""
        by_name: dict[str, list[tuple[int, int, int]]] = {}
        for (name, _), pieces in self.pieces.items():
            by_name.setdefault(name, []).extend((start, end, index) for start, end, index, _ in pieces)
        used = {self.whole[key][0] for key in whole if key in self.whole}
        for name, start, end in ranges:
            used.update(index for lo, hi, index in by_name.get(name, ()) if lo < end and hi > start)
        return [self.paths[index] for index in sorted(used)]

    def extent(self, name: str) -> int | None:
        """How many elements of `name` the files hold values for (None: none)."""
        whole = self.whole.get(f"{name}/full")
        if whole is not None:
            return math.prod(self._handles[whole[0]].get_slice(whole[1]).get_shape())
        ends = [piece[1] for kind in ("master", "param") for piece in self.pieces.get((name, kind), [])]
        return max(ends) if ends else None

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
