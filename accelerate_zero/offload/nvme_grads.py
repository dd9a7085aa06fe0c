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
from typing import TYPE_CHECKING

import torch

from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.norms import sum_of_squares
from accelerate_zero.offload.nvme import read_at, write_at


if TYPE_CHECKING:
    from accelerate_zero.engine.buckets import GradBucket


@dataclass
class SwappedGrad:
    """Where one bucket's gradient slice lives in the file, and what was last written there."""

    byte_offset: int
    numel: int
    norm: torch.Tensor | None = None
    """L2 norm (fp64, 0-dim) of the last value written."""
    writing: Future | None = None


class NvmeGradStore:
    """Keeps the gradient slices of `buckets` in one file (see the module docstring). Whether a slice holds this
    step's gradient is the bucket's to know: it says so when it adds (`fresh`) and reads only what it wrote."""

    def __init__(self, path: Path, buckets: list[GradBucket], buffer_count: int, copies: HostCopies) -> None:
        self.path, self.buffer_count, self.copies = path, max(1, buffer_count), copies
        self.entries: dict[int, SwappedGrad] = {}  # id(bucket) -> its place
        offset = 0
        for bucket in buckets:
            self.entries[id(bucket)] = SwappedGrad(offset, bucket.plan.shard_numel)
            offset += 4 * bucket.plan.shard_numel
        with open(path, "wb") as file:
            file.truncate(offset)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelerate_zero_nvme_grads")
        self._writes: collections.deque[tuple[Future, torch.Tensor]] = collections.deque()
        self.peak_resident = 0
        """Most gradient slices in memory at once (being written)."""

    def accumulate(self, bucket: GradBucket, reduced: torch.Tensor, post: float, fresh: bool) -> None:
        """Adds `reduced * post` to the bucket's slice; `fresh` overwrites it (the file holds an earlier step's)."""
        entry = self.entries[id(bucket)]
        # A private fp32 copy, scaled where it was reduced; the writer thread brings it to host memory, so backward
        # does not wait for the copy ([Note: asynchronous host copies] in engine/host_copies.py).
        scaled = reduced.to(torch.float32, copy=True)
        if post != 1.0:
            scaled.mul_(post)
        fetch = self.copies.to_host_in_worker(scaled)
        while len(self._writes) >= self.buffer_count:
            self._writes.popleft()[0].result()
        entry.writing = self._pool.submit(self._land, entry, fetch, fresh)
        self._writes.append((entry.writing, scaled))
        self.peak_resident = max(self.peak_resident, sum(not w.done() for w, _ in self._writes))

    def _land(self, entry: SwappedGrad, fetch: Callable[[], torch.Tensor], fresh: bool) -> None:
        """On the writer thread (one: a bucket's earlier write is done before its next starts)."""
        values = fetch()
        if not fresh:
            earlier = torch.empty(entry.numel, dtype=torch.float32)
            read_at(self.path, entry.byte_offset, earlier)
            values.add_(earlier)
        entry.norm = sum_of_squares([values]).sqrt()  # [Note: the norm of a large flat buffer]
        write_at(self.path, entry.byte_offset, values)

    def read(self, bucket: GradBucket, start: int, end: int) -> torch.Tensor:
        """A fresh fp32 tensor with elements [start, end) of the bucket's slice as last written."""
        entry = self.entries[id(bucket)]
        if entry.writing is not None:
            entry.writing.result()  # reads run on other threads too (the optimizer's read-ahead)
        values = torch.empty(end - start, dtype=torch.float32)
        read_at(self.path, entry.byte_offset + 4 * start, values)
        return values

    def norm(self, bucket: GradBucket) -> torch.Tensor:
        """The L2 norm of the bucket's slice as last written (taken when it was written: no read)."""
        entry = self.entries[id(bucket)]
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
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
