"""NVMe offload of the fp32 gradient shard (ZeRO-Infinity): each reduced bucket slice goes to a file at once.

Under `offload_optimizer.device: nvme` at stages 2 and 3 the averaged gradient slice a bucket's reduction leaves
on this rank is not kept in host memory (4 bytes per element of the shard, as much as the parameters in fp32):
it is written to this rank's gradient file at the bucket's offset by a thread, and the next micro-step of an
accumulation reads it back, adds and writes again. The optimizer step reads each sub-group's slices back (in the
read-ahead of offload/nvme.py). At most `buffer_count` slices are in memory being written.

The clipping norm needs the whole gradient before any sub-group steps. Each write computes the L2 norm of the
slice it writes; a bucket's last write in a step holds its final value, so the norm of the swapped buckets is
known without reading the file. The file is raw fp32 bytes (offload/nvme.py `read_at`/`write_at`, never
unpickled) in the optimizer's folder, `<nvme_path>/accelerate_zero/rank<R>/gradients.bin`, removed with it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.norms import sum_of_squares
from accelerate_zero.offload.nvme import read_at, write_at


@dataclass
class SwappedGrad:
    """Where one bucket's gradient slice lives in the file, and what was last written there."""

    byte_offset: int
    numel: int
    norm: torch.Tensor | None = None
    """L2 norm (fp64, 0-dim) of the last value written."""
    writing: Future | None = None


class NvmeGradSlot:
    """One bucket's slice in the store's file: a `KeptGradient` (engine/kept_grads.py). Whether it holds this
    step's gradient is the bucket's to know: it says so when it adds (`fresh`); a cleared slot reads zeros."""

    in_host = True

    def __init__(self, store: NvmeGradStore, entry: SwappedGrad) -> None:
        self.store, self.entry, self.numel = store, entry, entry.numel
        self._zeros = True  # nothing written in this step yet

    def add(self, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        self.store.accumulate(self.entry, reduced, post, fresh=fresh or self._zeros)
        self._zeros = False

    def read(self, start: int, end: int) -> torch.Tensor:
        if self._zeros:
            return torch.zeros(end - start, dtype=torch.float32)
        return self.store.read(self.entry, start, end)

    def square_norm(self, device: torch.device) -> torch.Tensor:
        if self._zeros:
            return torch.zeros((), dtype=torch.float64, device=device)
        return self.store.norm(self.entry).to(device=device, dtype=torch.float64).square()

    def clear(self) -> None:
        self._zeros = True

    def settle(self) -> None:
        pass  # `accumulate` copied what it was given before returning

    def reset(self) -> None:
        self._zeros = True

    def tensors(self) -> list[torch.Tensor]:
        return []  # the store's slices being written are counted by `NvmeGradStore.resident_tensors`


class NvmeGradStore:
    """Keeps gradient slices in one file (see the module docstring): `slot` gives each bucket its place while the
    engine is built, `open` then creates the file once its folder was checked."""

    def __init__(self, buffer_count: int, copies: HostCopies) -> None:
        self.buffer_count, self.copies = max(1, buffer_count), copies
        self.path: Path | None = None
        self.numel = 0
        """Elements of every slot."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelerate_zero_nvme_grads")
        self._writes: collections.deque[tuple[Future, torch.Tensor]] = collections.deque()
        self.peak_resident = 0
        """Most gradient slices in memory at once (being written)."""

    def slot(self, numel: int) -> NvmeGradSlot:
        assert self.path is None, "NvmeGradStore.slot() after open()"
        entry = SwappedGrad(4 * self.numel, numel)
        self.numel += numel
        return NvmeGradSlot(self, entry)

    def open(self, path: Path) -> None:
        """Creates the file (`4 * numel` bytes) the slots live in."""
        self.path = path
        with open(path, "wb") as file:
            file.truncate(4 * self.numel)

    def accumulate(self, entry: SwappedGrad, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        """Adds `reduced * post` to the entry's slice; `fresh` overwrites it (the file holds an earlier step's)."""
        assert self.path is not None, "NvmeGradStore.open() before the first gradient"
        # A private fp32 copy, scaled where it was reduced; the writer thread brings it to host memory, so backward
        # does not wait for the copy ([Note: asynchronous host copies] in engine/host_copies.py).
        scaled = reduced.to(torch.float32, copy=True)
        if post != 1.0:
            scaled.mul_(post)
        fetch = self.copies.to_host_in_worker(scaled)
        while len(self._writes) >= self.buffer_count:
            self._writes.popleft()[0].result()
        entry.writing = self._pool.submit(self._land, self.path, entry, fetch, fresh)
        self._writes.append((entry.writing, scaled))
        self.peak_resident = max(self.peak_resident, sum(not w.done() for w, _ in self._writes))

    @staticmethod
    def _land(path: Path, entry: SwappedGrad, fetch: Callable[[], torch.Tensor], fresh: bool) -> None:
        """On the writer thread (one: a slice's earlier write is done before its next starts)."""
        values = fetch()
        if not fresh:
            earlier = torch.empty(entry.numel, dtype=torch.float32)
            read_at(path, entry.byte_offset, earlier)
            values.add_(earlier)
        entry.norm = sum_of_squares([values]).sqrt()  # [Note: the norm of a large flat buffer]
        write_at(path, entry.byte_offset, values)

    def read(self, entry: SwappedGrad, start: int, end: int) -> torch.Tensor:
        """A fresh fp32 tensor with elements [start, end) of the slice as last written."""
        assert self.path is not None
        if entry.writing is not None:
            entry.writing.result()  # reads run on other threads too (the optimizer's read-ahead)
        values = torch.empty(end - start, dtype=torch.float32)
        read_at(self.path, entry.byte_offset + 4 * start, values)
        return values

    def norm(self, entry: SwappedGrad) -> torch.Tensor:
        """The L2 norm of the slice as last written (taken when it was written: no read)."""
        if entry.writing is not None:
            entry.writing.result()  # the norm is taken by the write
        norm = entry.norm
        assert norm is not None, "norm() of a slice never written"
        return norm

    def flush(self) -> None:
        while self._writes:
            self._writes.popleft()[0].result()

    # ---------------------------------------------------------------- queries
    def resident_tensors(self) -> list[torch.Tensor]:
        """Slices still in memory because their write has not finished (for memory accounting)."""
        while self._writes and self._writes[0][0].done():
            self._writes.popleft()[0].result()
        return [values for _, values in self._writes]

    def file_bytes(self) -> int:
        return self.path.stat().st_size if self.path is not None and self.path.exists() else 0

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
