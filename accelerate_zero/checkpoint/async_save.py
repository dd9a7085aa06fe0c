"""Checkpoint saves written by a background thread while training goes on.

[Note: asynchronous saves]
`save_checkpoint(..., async_save=True)` does on the training thread only what needs the engine or the other ranks:
the tag check, the frozen fingerprints, the shared-folder check, and a snapshot of everything the rank writes (host
copies of its masters, optimizer state and frozen shards, and on rank 0 the scheduler, client state and meta.json's
fields). A writer thread then writes the snapshot as the synchronous save would (the same parts and checksums). It
never calls a collective (two threads must not share one process group's sequence of collectives): each rank's
writer leaves a marker `.rank<R>.done` (or `.rank<R>.failed` with its error) in the partial folder, and rank 0's
writer, having seen a marker from every rank, writes meta.json and publishes the folder as a synchronous save does
(checkpoint/io.py): a job killed while any writer runs leaves `latest` naming the previous checkpoint.

Every rank joins its writers before the next save or load starts (a second save waits for the first; a load by
another engine of the process waits too), and the ranks
then exchange the writers' errors in one small all-gather, so a failed write is raised on every rank at that call,
naming the rank. The snapshot is copied into host buffers kept for the next save (`stage`): the rank's share of the
checkpoint stays in host memory between saves (`release_staging` frees it), as torch's `async_save` caches its
staged state dict.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.groups import DataParallelGroup


WAIT_FOR_RANKS_SECONDS = 1800.0
"""How long rank 0's writer waits for every rank's marker (the default process-group timeout)."""
_POLL_SECONDS = 0.02


def _marker(work: Path, rank: int, kind: str) -> Path:
    return work / f".rank{rank:05d}.{kind}"


def mark_done(work: Path, rank: int) -> None:
    _marker(work, rank, "done").write_text("")


def mark_failed(work: Path, rank: int, error: BaseException) -> None:
    _marker(work, rank, "failed").write_text(f"{type(error).__name__}: {error}")


def wait_for_ranks(work: Path, world_size: int, timeout: float = WAIT_FOR_RANKS_SECONDS) -> None:
    """Returns once every rank's writer left its done marker in `work`, and removes the markers.

    Raises:
        OSError: a rank's writer failed (naming the rank and its error).
        TimeoutError: some ranks left no marker within `timeout` seconds (naming them).
    """
    deadline = time.monotonic() + timeout
    waiting = set(range(world_size))
    while waiting:
        for rank in sorted(waiting):
            failed = _marker(work, rank, "failed")
            if failed.is_file():
                raise OSError(f"rank {rank}'s checkpoint writer failed ({failed.read_text()}): {work} not published")
            if _marker(work, rank, "done").is_file():
                waiting.discard(rank)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(waiting)} did not finish writing {work} within {timeout:.0f} s: not published"
            )
        if waiting:
            time.sleep(_POLL_SECONDS)
    for rank in range(world_size):
        _marker(work, rank, "done").unlink()


class _Writer:
    """One rank's writer thread and what it raised."""

    def __init__(self, job: Callable[[], None], name: str) -> None:
        self.error: BaseException | None = None
        # Not a daemon: a script that ends right after a save still finishes (and publishes) it.
        self.thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=False)
        self.thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        _lower_priority()
        try:
            job()
        except BaseException as error:  # raised on the training thread by `finish`
            self.error = error


WRITER_NICENESS = 19
"""The writer thread's `nice` value (Linux: per thread): serializing and hashing cost CPU time, which training
threads get first."""


def _lower_priority() -> None:
    if hasattr(os, "setpriority"):  # Linux: PRIO_PROCESS with a thread id sets that thread's niceness
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)


# The writer in flight per engine, by the engine's id: held strongly, so that an engine dropped while its writer
# runs (a new engine then loads what it saved) still has its writer waited for by `finish`.
_IN_FLIGHT: dict[int, _Writer] = {}


# Host buffers a save's snapshot is copied into, per engine, kept between saves: a fresh allocation costs a page
# fault per 4 KiB page on first touch (measured on a 2-core VM:
# 96 MiB copied into new memory in 0.19 s, into reused memory in 0.09 s).
_STAGING: weakref.WeakKeyDictionary[object, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def stage(engine: object, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies every (key, tensor) into `engine`'s host staging buffer for that key (made or remade when the shape or
    dtype differs); the buffers of keys this save does not have are dropped. Call only once the previous save's
    writer is done (`finish`): it reads the same buffers."""
    cache = _STAGING.setdefault(engine, {})
    staged = []
    for key, tensor in tensors:
        buffer = cache.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buffer.copy_(tensor)
        staged.append((key, buffer))
    _STAGING[engine] = dict(staged)
    return staged


def release_staging(engine: object) -> None:
    """Frees `engine`'s staging buffers (the host memory of its last asynchronous save); after `finish`."""
    _STAGING.pop(engine, None)


def start(engine: object, job: Callable[[], None]) -> None:
    """Runs `job` (one save of `engine`) in a background thread; `finish` must have been called since the last one."""
    if id(engine) in _IN_FLIGHT:
        raise RuntimeError("an asynchronous checkpoint save is still in flight: call finish() before starting another")
    _IN_FLIGHT[id(engine)] = _Writer(job, "accelerate_zero checkpoint writer")


def in_flight(engine: object) -> bool:
    """Whether a save of `engine` was started and not finished (its writer may be done)."""
    return id(engine) in _IN_FLIGHT


def finish(world: DataParallelGroup) -> None:
    """Waits for every save in flight in this process (any engine's: a new engine may load what an old one was
    saving); every rank must call it. Once it returns, those checkpoints are published.

    Raises:
        OSError: some rank's writer failed (on every rank, naming the rank and its error); the previous checkpoint is
            still the one `latest` names.
    """
    writers = list(_IN_FLIGHT.values())
    _IN_FLIGHT.clear()
    if not writers:  # every rank started the same saves: none of them has one in flight
        return
    for writer in writers:
        writer.thread.join()
    failed_here = next((writer.error for writer in writers if writer.error is not None), None)
    error = None if failed_here is None else f"{type(failed_here).__name__}: {failed_here}"
    errors = collectives.all_gather_object(error, world)
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if failed:
        rank, text = failed[0]
        raise OSError(
            f"the asynchronous checkpoint save failed on rank {rank} ({text}); `latest` still names the previous "
            "checkpoint. Fix the cause and save again"
        ) from failed_here
