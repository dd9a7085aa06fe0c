"""NVMe offload of stage-3 parameter shards (ZeRO-Infinity): each unit's shard lives in a file between uses.

[Note: when a swapped shard is in memory]
A unit's shard is only read to feed its all-gather (the gathered full buffer is what forward and backward use)
and written after the optimizer step updated the fp32 masters. So a swapped shard is in memory from the moment
its unit starts gathering until the all-gather finished (a swapped unit's all-gather is waited for at once, so
the bound below holds however many units the scheduler prefetches), or while a read-ahead for it is in flight; the
optimizer step never reads it: every element of a trainable shard is some slice's master, cast to the compute
dtype and written into the file at its offset (write-behind threads, drained before the next read). A swapped
flat's `shard` is an empty placeholder at rest and a freshly allocated buffer (pinned where the device has pinned
memory) while read; the optimizer's slices of a swapped shard are cut from that placeholder (their fp32 masters
are read from the file), since every write and read of a swapped shard goes through this store.

DeepSpeed's keys, as DeepSpeed documents them:
- `max_in_cpu`: the first `max_in_cpu` shard elements (units in model order) stay in host memory for good; only
  the rest go to files. The default (1e9) keeps every shard of a model under 1e9 elements per rank in memory,
  as DeepSpeed does; set it to 0 to put every shard on disk.
- `buffer_count`: at most this many swapped shards are in memory at once (being gathered, read ahead, written).
- `buffer_size`: elements per buffer; every swapped shard must fit in one (checked at startup). Buffers are
  allocated at the size of the shard they hold, so a generous `buffer_size` costs no memory.
Files live under `<nvme_path>/accelerate_zero/params/rank<R>/`, one raw file per flat buffer of a unit (read and
written as bytes, never unpickled); stale ones are removed at start, ours when the engine is destroyed or the
process exits.
"""

from __future__ import annotations

import collections
import os
import shutil
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.offload.nvme import check_folder, read_at, tensor_bytes, write_at


def param_rank_folder(nvme_path: str, rank: int) -> Path:
    return Path(nvme_path) / "accelerate_zero" / "params" / f"rank{rank:05d}"


def preload_rank_folder(nvme_path: str, rank: int) -> Path:
    """Where `from_pretrained` spills the shards that will be swapped, until the engine's store adopts the files."""
    return Path(nvme_path) / "accelerate_zero" / "preload" / f"rank{rank:05d}"


def swapped_flags(shard_numels: list[int], max_in_cpu: int) -> list[bool]:
    """Which shards go to files: all but the first `max_in_cpu` elements, in unit order (DeepSpeed's `max_in_cpu`)."""
    kept, flags = 0, []
    for numel in shard_numels:
        stays = kept + numel <= max_in_cpu
        kept += numel if stays else 0
        flags.append(not stays)
    return flags


def spill_shard(flat: FlatUnitBuffer, path: Path) -> None:
    """Writes `flat.shard` (on any device) to `path`, frees its memory (also what views of it held) and leaves an
    empty placeholder.

    The shard must own its storage: a buffer cut from a shared host chunk cannot be freed alone ([Note: where an
    offloaded shard settles] in engine/stage3/build.py)."""
    shard = flat.shard
    storage = shard.untyped_storage()
    owned = shard.storage_offset() == 0 and storage.nbytes() == shard.numel() * shard.element_size()
    assert owned, f"{flat!r}: its shard shares storage ({storage.nbytes()} bytes) with other tensors: cannot spill it"
    with open(path, "wb") as file:
        file.write(tensor_bytes(shard.detach().to("cpu", copy=True)))  # numpy views make a storage unresizable
    storage.resize_(0)
    flat.shard = shard.new_empty(0)


@dataclass
class SwappedShard:
    """One flat buffer's shard kept in a file."""

    flat: FlatUnitBuffer
    path: Path
    reading: Future | None = None
    """The read filling `flat.shard` (a read-ahead or a gather's own read)."""
    resident: bool = False
    """`flat.shard`'s storage holds the file's values."""


class NvmeParamStore:
    """A `ShardStore` (engine/stores.py) keeping some unit shards in files and bringing them into memory for the
    all-gather (see the notes above); the shards it was not given stay in memory.

    Built before the units (they are constructed with it), empty; `take` then moves the chosen shards into files."""

    gates_reads = False  # its reads and writes of files are in flight of their own: the host step stays synchronous

    def gate_reads(self, wait_for: Callable[[torch.Tensor], None]) -> None:
        raise AssertionError("NvmeParamStore does not gate its reads (gates_reads is False)")

    def __init__(
        self,
        nvme_path: str,
        rank: int,
        *,
        buffer_count: int,
        buffer_size: int,
        pin_memory: bool,
        max_in_cpu: int = 0,
    ) -> None:
        self.nvme_path, self.rank, self.buffer_size, self.max_in_cpu = nvme_path, rank, buffer_size, max_in_cpu
        self.buffer_count, self.pin_memory = max(1, buffer_count), pin_memory
        self.folder: Path | None = None
        self.shards: dict[int, SwappedShard] = {}  # id(flat) -> its file
        self.by_bucket: dict[int, SwappedShard] = {}  # id(unit.bucket) -> the trainable flat's file
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="accelerate_zero_nvme_params")
        self._writes: collections.deque[Future] = collections.deque()
        self.peak_resident = 0
        """Most swapped shards in memory (or in flight to a file) at once."""
        self._finalizer: weakref.finalize | None = None

    def place(self, units: list[ParamUnit], spilled: dict[int, Path]) -> None:
        """The `ShardStore` contract: every shard beyond `max_in_cpu` elements (in unit order) goes to a file."""
        self.take(choose_swapped(units, self.max_in_cpu), spilled)

    def take(self, swapped: list[tuple[ParamUnit, FlatUnitBuffer]], spilled: dict[int, Path] | None = None) -> None:
        """Checks `buffer_size` and the path, then moves the `swapped` shards into files (once).

        `spilled`: id(flat) -> the file partitioned loading already wrote its shard to (moved, not copied).

        Raises:
            ValueError: a shard is larger than `buffer_size` (naming the unit and the size needed).
            OSError: the path is not writable or lacks room (naming the host, the path and the bytes).
        """
        assert self.folder is None, "NvmeParamStore.take() is called once"
        largest = max(swapped, key=lambda e: e[1].plan.shard_numel, default=None)
        if largest is not None and largest[1].plan.shard_numel > self.buffer_size:
            unit, flat = largest
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size={self.buffer_size} is smaller than the shard of unit "
                f"{unit.name or '<root>'!r} ({flat.plan.shard_numel} elements on rank {self.rank}): set buffer_size "
                f"to at least {flat.plan.shard_numel}"
            )
        needed = sum(flat.plan.shard_numel * flat.shard.element_size() for _, flat in swapped)
        self.folder = folder = check_folder(
            "zero_optimization.offload_param.nvme_path",
            self.nvme_path,
            param_rank_folder(self.nvme_path, self.rank),
            self.rank,
            needed,
            "its parameter shards",
        )
        for unit, flat in swapped:
            kind = "trainable" if flat is unit.trainable else "frozen"
            entry = SwappedShard(flat, folder / f"unit{unit.index:05d}_{kind}.bin")
            self.shards[id(flat)] = entry
            if flat is unit.trainable and unit.bucket is not None:
                self.by_bucket[id(unit.bucket)] = entry
        spilled = spilled or {}
        for entry in self.shards.values():
            if id(entry.flat) in spilled:
                os.replace(spilled[id(entry.flat)], entry.path)  # the shard never was in memory
                continue
            spill_shard(entry.flat, entry.path)  # the optimizer's slices are cut afterwards, from the placeholder
        self._finalizer = weakref.finalize(self, shutil.rmtree, folder, True)

    # ------------------------------------------------------------- gathering
    def swapped(self, flat: FlatUnitBuffer) -> bool:
        return id(flat) in self.shards

    def acquire(self, flat: FlatUnitBuffer) -> torch.Tensor:
        """`flat.shard` with its values in memory (read now unless a read-ahead already brought it)."""
        entry = self.shards.get(id(flat))
        if entry is None:
            return flat.shard
        if not entry.resident:
            self._start_read(entry)
        if entry.reading is not None:
            reading, entry.reading = entry.reading, None  # a failed read raises here once, not again on release
            reading.result()
        return flat.shard

    def release(self, flat: FlatUnitBuffer) -> None:
        """Frees the shard's memory once its all-gather finished (its file is current: nothing to write)."""
        entry = self.shards.get(id(flat))
        if entry is not None and entry.resident:
            if entry.reading is not None:
                reading, entry.reading = entry.reading, None
                reading.result()
            flat.shard = flat.shard.new_empty(0)
            entry.resident = False

    def read_ahead(self, flats: list[FlatUnitBuffer]) -> None:
        """Starts reading the shards of the flat buffers gathered next, while buffers are free."""
        for flat in flats:
            entry = self.shards.get(id(flat))
            if entry is None or entry.resident:
                continue
            if self._resident_count() >= self.buffer_count - 1:  # one buffer stays free for acquire()
                return
            self._start_read(entry)

    def _start_read(self, entry: SwappedShard) -> None:
        while self._writes:  # a shard file is read only once every write into it landed
            self._writes.popleft().result()
        flat = entry.flat
        flat.shard = torch.empty(flat.plan.shard_numel, dtype=flat.shard.dtype, pin_memory=self.pin_memory)
        entry.resident = True
        entry.reading = self._pool.submit(read_at, entry.path, 0, entry.flat.shard)
        self._note_peak()

    def _resident_count(self) -> int:
        return sum(e.resident for e in self.shards.values()) + sum(not w.done() for w in self._writes)

    def _note_peak(self) -> None:
        self.peak_resident = max(self.peak_resident, self._resident_count())

    # --------------------------------------------------------------- updates
    def holds(self, shard_slice: ShardSlice) -> bool:
        return id(shard_slice.bucket) in self.by_bucket

    def write_slice(self, shard_slice: ShardSlice) -> None:
        """Writes the slice's master (cast to the parameters' dtype) into its shard file, behind the caller."""
        entry = self.by_bucket[id(shard_slice.bucket)]
        values = shard_slice.master.detach().to(dtype=entry.flat.shard.dtype, device="cpu", copy=True)
        self._write(entry, shard_slice.start, values)

    def read_slice(self, shard_slice: ShardSlice) -> torch.Tensor:
        entry = self.by_bucket[id(shard_slice.bucket)]
        return self.read(entry.flat)[shard_slice.start : shard_slice.end]

    def read(self, flat: FlatUnitBuffer) -> torch.Tensor:
        """A copy of the whole shard (checkpoints, GatheredParameters writes); a shard kept in memory as it is."""
        entry = self.shards.get(id(flat))
        if entry is None:
            return flat.shard
        self.flush()
        values = torch.empty(flat.plan.shard_numel, dtype=flat.shard.dtype)
        read_at(entry.path, 0, values)
        return values

    def overwrite(self, flat: FlatUnitBuffer, values: torch.Tensor, offset: int = 0) -> None:
        entry = self.shards.get(id(flat))
        if entry is None:
            flat.shard[offset : offset + values.numel()].copy_(values)
            return
        self._write(entry, offset, values.detach().to(flat.shard.dtype, copy=True).cpu())

    def _write(self, entry: SwappedShard, offset: int, values: torch.Tensor) -> None:
        self.release(entry.flat)  # a copy read ahead before this write would be stale
        while self._writes and self._resident_count() >= self.buffer_count:
            self._writes.popleft().result()
        byte_offset = offset * values.element_size()
        self._writes.append(self._pool.submit(write_at, entry.path, byte_offset, values))
        self._note_peak()

    def flush(self) -> None:
        """Waits for every write (before the next read of any shard) and drops every shard read ahead: between steps
        no swapped shard is in memory (a rank whose slice of a unit is padding only writes nothing to release it)."""
        while self._writes:
            self._writes.popleft().result()
        for entry in self.shards.values():
            self.release(entry.flat)

    # ---------------------------------------------------------------- queries
    def file_bytes(self) -> int:
        return sum(e.path.stat().st_size for e in self.shards.values() if e.path.exists())

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
        if self._finalizer is not None:
            self._finalizer()


def choose_swapped(units: list[ParamUnit], max_in_cpu: int) -> list[tuple[ParamUnit, FlatUnitBuffer]]:
    """The flat buffers whose shards go to files: all but the first `max_in_cpu` elements, in unit order."""
    flats = [(unit, flat) for unit in units for flat in unit.flats]
    flags = swapped_flags([flat.plan.shard_numel for _, flat in flats], max_in_cpu)
    return [entry for entry, swapped in zip(flats, flags, strict=True) if swapped]
