"""What a rank reads about itself: resident memory and its peak, bytes on the wire, live tensors, collective bytes.

Only torch and the standard library are imported here: a rank running in DeepSpeed's own virtualenv (where
accelerate_zero is not installed) reads itself with the same code as every other peer.

How each reading is taken: bench/README.md, "How each number is measured".
"""

from __future__ import annotations

import gc
import threading
import warnings
from dataclasses import dataclass, field

import torch


STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux `clear_refs` value 5); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def wire_bytes() -> int:
    """Bytes this process has passed to write-family system calls (gloo's sends among them), all threads."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages behind every tensor the garbage collector tracks."""
    seen, total = set(), 0
    with warnings.catch_warnings():
        # isinstance() on deprecated torch.distributed module aliases found by the scan warns.
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
            # FSDP2's freed unsharded parameters leave tensors whose storage is invalid: data_ptr() raises.
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, ReferenceError):
            continue
        if pointer in seen or nbytes == 0:
            continue
        seen.add(pointer)
        total += nbytes
    return total


class PeakSampler:
    """The highest value of each /proc/self/status key per phase, polled every `interval` seconds.

    VmHWM holds one peak for the whole RSS; this splits it (anonymous against file-backed pages), gives one peak
    per phase, or measures a peak where `clear_refs` is not allowed. `with PeakSampler() as peaks: ...`, then
    `peaks.peak["RssAnon"]` (the current phase's); or `start()`, `phase(name)` at each phase, `stop()` for
    {"peaks": {phase: {key: bytes}}, "ends": {phase: {key: bytes at its end}}}.
    """

    def __init__(
        self, keys: tuple[str, ...] = ("VmRSS", "RssAnon", "RssFile"), interval: float = 0.002, phase: str = "run"
    ) -> None:
        self.keys, self.current = keys, phase
        self.peaks: dict[str, dict[str, int]] = {}
        self.ends: dict[str, dict[str, int]] = {}
        self._interval, self._done, self._lock = interval, threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @property
    def peak(self) -> dict[str, int]:
        """The peaks of the current (after `stop`: the last) phase."""
        return self.peaks.get(self.current, dict.fromkeys(self.keys, 0))

    def read(self) -> dict[str, int]:
        return {key: value for key, value in proc_status().items() if key in self.keys}

    def _record(self) -> None:
        reading = self.read()
        with self._lock:
            peak = self.peaks.setdefault(self.current, dict(reading))
            for key, value in reading.items():
                peak[key] = max(peak[key], value)

    def _sample(self) -> None:
        while not self._done.is_set():
            self._record()
            self._done.wait(self._interval)

    def phase(self, name: str) -> None:
        """Ends the current phase (its peak and its end reading) and starts `name`."""
        self._record()
        with self._lock:
            self.ends[self.current], self.current = self.read(), name
        self._record()

    def start(self) -> PeakSampler:
        self._record()
        self._thread.start()
        return self

    def stop(self) -> dict[str, dict[str, dict[str, int]]]:
        self._done.set()
        self._thread.join()
        self._record()
        self.ends[self.current] = self.read()
        return {"peaks": self.peaks, "ends": self.ends}

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------- collective bytes
def ring_factor(kind: str, world_size: int) -> float:
    """Bytes each rank sends per byte of the collective's full buffer, by the ring algorithm's volume.

    all-reduce 2(W-1)/W; reduce-scatter and all-gather (W-1)/W of the full buffer; broadcast and reduce 1.
    """
    if world_size == 1:
        return 0.0
    if kind.startswith("all_reduce"):
        return 2 * (world_size - 1) / world_size
    if kind.startswith(("reduce_scatter", "all_gather")):
        return (world_size - 1) / world_size
    if kind in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"no ring-volume convention for collective kind {kind!r}")


@dataclass
class ByteCounter:
    """Counts collectives the way accelerate_zero's `comm_stats()` does, for the peers that have no counter."""

    world_size: int
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def record(self, kind: str, payload_bytes: int) -> None:
        entry = self.by_kind.setdefault(kind, {"calls": 0, "payload_bytes": 0, "bytes_per_rank": 0.0})
        entry["calls"] += 1
        entry["payload_bytes"] += payload_bytes
        entry["bytes_per_rank"] += payload_bytes * ring_factor(kind, self.world_size)

    def reset(self) -> None:
        self.by_kind.clear()

    def as_dict(self) -> dict[str, dict[str, float]]:
        return with_total(self.by_kind)


def with_total(by_kind: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """A copy of `by_kind` plus a "total" entry summing every field."""
    out = {kind: dict(entry) for kind, entry in sorted(by_kind.items()) if kind != "total"}
    out["total"] = {
        key: sum(entry[key] for entry in out.values()) for key in ("calls", "payload_bytes", "bytes_per_rank")
    }
    return out


def count_gradient_arenas_whole() -> None:
    """Makes each engine gradient arena resident when it is allocated, as a device's caching allocator counts it.

    [Note: resident pages against allocated bytes] The arena is `torch.empty` (engine/kept_grads.py): on the CPU its
    pages count in RSS only once written, and the stage-3 backward writes the shard one reduce-scatter at a time,
    so RSS at the start of backward holds a small part of it. A device allocator counts the whole arena from its
    allocation, and so does the estimate (accelerate_zero/debug/phases.py). This run-time wrapper of our own class
    (in the benchmark's rank only) fills it once at allocation so that RSS measures what a device would hold.
    """
    from accelerate_zero.engine.kept_grads import GradArena

    take = GradArena.take

    def take_resident(self: GradArena, offset: int, numel: int) -> torch.Tensor:
        fresh = self._flat is None
        slot = take(self, offset, numel)
        if fresh:
            self._flat.zero_()
        return slot

    GradArena.take = take_resident
