"""What a rank reads about itself: resident memory and its peak, bytes on the wire, live tensors, collective bytes.

Only torch and the standard library are imported here: a rank running in DeepSpeed's own virtualenv (where
accelerate_zero is not installed) reads itself with the same code as every other peer.

[Note: how the benchmark measures]
- Resident memory: `VmRSS` from /proc/self/status after `gc.collect()`, minus the same reading taken after the
  imports and the process group, before the model existed. The launcher sets `MALLOC_MMAP_THRESHOLD_=131072`
  (harness/launch.py) so that large tensors are mmap-ed and their pages go back to the OS when freed. `RssAnon`
  (the anonymous part, same difference) is kept too: RSS also counts file-backed pages of the shared libraries,
  which the kernel can drop under memory pressure from other processes (seen once: -70 MB of VmRSS in one run).
  The peak (`VmHWM`, reset at the baseline through /proc/self/clear_refs) minus the same baseline shows transient
  buffers; `PeakSampler` polls RssAnon and RssFile apart where VmHWM cannot tell them.
- Live tensor bytes: every torch.Tensor the garbage collector can see, each storage once (tensors held only by
  C++, such as DDP's gradient buckets, are not seen).
- Bytes per step: each system's own count (engine `comm_stats()`, a DDP comm hook, wrapped torch.distributed
  calls, DeepSpeed's comms logger) with one convention, the ring volume (`ring_factor`). Independently,
  `wchar` from /proc/self/io: gloo's TCP transport sends with writev(2), so `wchar` counts the bytes this
  process really put on the wire, whatever the algorithm.
- Step time (harness/steps.py): `dist.barrier()` then the full step timed on every rank; the step's time is the
  slowest rank's, the reported figure the median over the timed steps. The CPU time of the process (all its
  threads) over the same step is kept too: it moves less than wall time when other users load the machine,
  though it still counts time spent waiting in a spinning thread. Minor page faults per step (getrusage) count
  the pages touched for the first time: a buffer freed and allocated again every step (with the mmap threshold
  above) shows up as about one fault per 4 KiB of it.
- The machine's load: the 1-minute load average before and after every launch (harness/launch.py) and in every
  report's header (harness/report.py): a ratio read under load is noted as such.
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
