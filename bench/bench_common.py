"""What every benchmark worker shares: the model, the data, the measurements and the timed loop.

Only torch and the standard library are imported here: the DeepSpeed worker imports this module from its own
virtualenv, where accelerate_zero is not installed.

[Note: how the benchmark measures]
- Resident memory: `VmRSS` from /proc/self/status after `gc.collect()`, minus the same reading taken after the
  imports and the process group, before the model existed. The launcher sets `MALLOC_MMAP_THRESHOLD_=131072`
  so that large tensors are mmap-ed and their pages go back to the OS when freed. `RssAnon` (the anonymous
  part, same difference) is kept too: RSS also counts file-backed pages of the shared libraries, which the
  kernel can drop under memory pressure from other processes (seen once: -70 MB of VmRSS in one run). The
  peak (`VmHWM`, reset at the baseline through /proc/self/clear_refs) minus the same baseline shows transient
  buffers.
- Live tensor bytes: every torch.Tensor the garbage collector can see, each storage once (tensors held only by
  C++, such as DDP's gradient buckets, are not seen).
- Bytes per step: each system's own count (engine `comm_stats()`, a DDP comm hook, wrapped torch.distributed
  calls, DeepSpeed's comms logger) with one convention, the ring volume (`ring_factor`). Independently,
  `wchar` from /proc/self/io: gloo's TCP transport sends with writev(2), so `wchar` counts the bytes this
  process really put on the wire, whatever the algorithm.
- Step time: `dist.barrier()` then the full step (forward, backward, optimizer step) timed on every rank; the
  step's time is the slowest rank's, and the reported figure is the median over the timed steps. The CPU time
  of the process (all its threads) over the same step is kept too: it moves less than wall time when other
  users load the machine, though it still counts time spent waiting in a spinning thread. Minor page faults per
  step (getrusage) count the pages touched for the first time: a buffer freed and allocated again every step
  (with the mmap threshold above) shows up as about one fault per 4 KiB of it.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


# The model's size: 16 x Linear(1024, 1024) unless the launcher sets these variables (bench/report runs a smaller
# stack to fit its time budget); the workers of every system read them, DeepSpeed's included.
# AZ_BENCH_BATCH: the rows of each micro-batch (default 8: activations are negligible beside the weights; at 1024
# each saved activation is 4 MB, and the peak under gradient accumulation shows what lives across micro-steps).
SIZE_ENV = {"hidden": "AZ_BENCH_HIDDEN", "layers": "AZ_BENCH_LAYERS", "batch": "AZ_BENCH_BATCH"}
HIDDEN = int(os.environ.get(SIZE_ENV["hidden"], "1024"))
LAYERS = int(os.environ.get(SIZE_ENV["layers"], "16"))
MICRO_BATCH, LR = int(os.environ.get(SIZE_ENV["batch"], "8")), 1e-4
MODEL_SEED, DATA_SEED = 0, 1000


def build_model(hidden: int = HIDDEN, layers: int = LAYERS) -> nn.Sequential:
    """`layers` x `nn.Linear(hidden, hidden)` with a ReLU between them, the same on every rank.

    The default, 16 x Linear(1024, 1024), has 16.8M fp32 parameters.
    """
    torch.manual_seed(MODEL_SEED)
    modules: list[nn.Module] = []
    for index in range(layers):
        modules.append(nn.Linear(hidden, hidden))
        if index < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def make_batch(rank: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed random micro-batch (input, target) per rank, reused at every step."""
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    return torch.randn(MICRO_BATCH, hidden, generator=gen), torch.randn(MICRO_BATCH, hidden, generator=gen)


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
    """Counts collectives the way accelerate_zero's `comm_stats()` does, for the systems that have no counter."""

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


# ----------------------------------------------------------------------------------------- process readings
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
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


# ----------------------------------------------------------------------------------------------- the loop
@dataclass
class Measurement:
    """What one rank measured; the launcher combines the ranks."""

    rank: int
    world_size: int
    params: int
    baseline: dict[str, int]
    after_warmup: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    peak_reset: bool = False
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)
    step_minor_faults: list[int] = field(default_factory=list)
    wire_bytes_per_step: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    live_tensor_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def start_measurement() -> Measurement:
    """Takes the baseline: call after the imports and the process group, before the model exists."""
    gc.collect()
    dist.barrier()
    baseline = proc_status()
    peak_reset = reset_peak_rss()
    return Measurement(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        params=0,
        baseline=baseline,
        peak_reset=peak_reset,
    )


def run_steps(
    measurement: Measurement,
    step: Callable[[], torch.Tensor],
    *,
    warmup: int,
    steps: int,
    reset_comm: Callable[[], None],
) -> None:
    """Runs `warmup` untimed then `steps` timed steps; `reset_comm` is called between the two phases."""
    for _ in range(warmup):
        measurement.losses.append(float(step()))
    gc.collect()
    measurement.after_warmup = proc_status()
    dist.barrier()
    reset_comm()
    for _ in range(steps):
        dist.barrier()
        faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        wire_start, cpu_start, start = wire_bytes(), time.process_time(), time.perf_counter()
        loss = step()
        measurement.step_seconds.append(time.perf_counter() - start)
        measurement.step_cpu_seconds.append(time.process_time() - cpu_start)
        measurement.step_minor_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start)
        measurement.wire_bytes_per_step.append(wire_bytes() - wire_start)
        measurement.losses.append(float(loss))
    gc.collect()
    dist.barrier()
    measurement.after = proc_status()
    measurement.live_tensor_bytes = live_tensor_bytes()


def finish(measurement: Measurement, out_path: str) -> None:
    """Gathers every rank's measurement and has rank 0 write them as JSON to `out_path`."""
    records: list[Any] = [None] * measurement.world_size
    dist.all_gather_object(records, vars(measurement))
    if measurement.rank == 0:
        with open(out_path, "w") as out:
            json.dump(records, out)
    dist.barrier()
    dist.destroy_process_group()
