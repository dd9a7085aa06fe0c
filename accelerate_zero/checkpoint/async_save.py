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

[Note: the snapshot is copied by the writer]
The copy into the staging buffers is most of what a save costs the training thread (measured: 20-100 ms of a 0.1-1.4
s step for a 96 MiB checkpoint, bench/checkpoints.py). The masters and the optimizer's state, when they are in
host memory, only change in an optimizer step, so the writer thread copies those itself, first, while the next
forward and backward run, and every `torch.optim` optimizer's step waits until that copy is done (a global step
pre-hook, `register_optimizer_step_pre_hook`). Only what lives in the optimizer's own storages (its parameters and
state, matched by storage address) is left for the writer; the rest is copied at once: device tensors (a copy from
the device stays on the training thread, ordered with its streams), buffers (a forward changes running statistics),
parameters the optimizer does not hold, and everything under NVMe offload (its views live in buffers reused for the
next sub-group). A load or a second save joins the writer first, so it finds the copy done. What else could write those
tensors while the copy is pending: `offload_states()` (sleep) of a CPU-resident engine, which resizes storages;
it must call `wait_for_snapshots()` first.
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
from torch.optim.optimizer import register_optimizer_step_pre_hook

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

    def __init__(self, job: Callable[[], None], name: str, snapshot: _Snapshot | None = None) -> None:
        self.error: BaseException | None = None
        self.snapshot = snapshot
        # Not a daemon: a script that ends right after a save still finishes (and publishes) it.
        self.thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=False)
        self.thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            if self.snapshot is not None:
                self.snapshot.copy()  # at the training threads' priority: the next optimizer step waits for it
            _lower_priority()
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


class _Snapshot:
    """The copies `stage` left for the writer ([Note: the snapshot is copied by the writer]) and when they are done."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.copies = copies
        self.done = threading.Event()

    def copy(self) -> None:
        try:
            for buffer, source in self.copies:
                buffer.copy_(source)
        finally:
            self.copies = []
            self.done.set()


# The snapshot each engine's writer has still to copy, by the engine's id (set by `stage`, taken by `start`).
_UNCOPIED: dict[int, _Snapshot] = {}
_STEP_HOOK: list[object] = []


def _stepped_storages(engine: object) -> set[int]:
    """The host storages only `engine`'s optimizer step writes (its masters and their state), by address; none under
    NVMe offload (its views live in buffers reused for the next sub-group)."""
    zero = getattr(getattr(engine, "config", None), "zero_optimization", None)
    blocks = (getattr(zero, "offload_optimizer", None), getattr(zero, "offload_param", None))
    if zero is None or any(getattr(block, "device", "none") == "nvme" for block in blocks):
        return set()
    optimizer = engine.checkpoint_state().optimizer  # type: ignore[attr-defined]
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}


def stage(engine: object, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies every (key, tensor) into `engine`'s host staging buffer for that key (made or remade when the shape or
    dtype differs), or leaves the copy to the writer ([Note: the snapshot is copied by the writer]); the buffers of
    keys this save does not have are dropped. Call only once the previous save's writer is done (`finish`): it reads
    the same buffers; then `start` the writer."""
    cache = _STAGING.setdefault(engine, {})
    staged, deferred = [], []
    stepped = _stepped_storages(engine)
    for key, tensor in tensors:
        buffer = cache.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in stepped:
            deferred.append((buffer, tensor))
        else:
            buffer.copy_(tensor)
        staged.append((key, buffer))
    _STAGING[engine] = dict(staged)
    if deferred:
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_pre_hook(_wait_before_step))
        _UNCOPIED[id(engine)] = _Snapshot(deferred)
    return staged


def _wait_before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    wait_for_snapshots()


def wait_for_snapshots() -> None:
    """Returns once every writer has copied its snapshot ([Note: the snapshot is copied by the writer]); call before
    changing a trained tensor other than by an optimizer step."""
    for snapshot in list(_UNCOPIED.values()):  # staged, its writer not started (it raised in between): copy here
        snapshot.copy()
    _UNCOPIED.clear()
    for writer in list(_IN_FLIGHT.values()):
        if writer.snapshot is not None:
            writer.snapshot.done.wait()


def release_staging(engine: object) -> None:
    """Frees `engine`'s staging buffers (the host memory of its last asynchronous save); after `finish`."""
    _STAGING.pop(engine, None)


def start(engine: object, job: Callable[[], None]) -> None:
    """Runs `job` (one save of `engine`) in a background thread; `finish` must have been called since the last one."""
    if id(engine) in _IN_FLIGHT:
        raise RuntimeError("an asynchronous checkpoint save is still in flight: call finish() before starting another")
    _IN_FLIGHT[id(engine)] = _Writer(job, "accelerate_zero checkpoint writer", _UNCOPIED.pop(id(engine), None))


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
