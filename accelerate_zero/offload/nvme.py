"""NVMe offload of the optimizer (ZeRO-Infinity): fp32 masters and optimizer state live in files between steps.

The shard's slices are cut into sub-groups of at most `sub_group_size` elements. At the step each sub-group is
read from its file (the next one is read ahead by a thread), stepped with the user's optimizer on the CPU, copied
into the parameters, and written back by a thread, so at most `buffer_count` sub-groups are in memory at once.
Between steps a master slice holds an empty placeholder. Files live under `<nvme_path>/accelerate_zero/rank<R>/`;
stale ones from an earlier job are removed at start, ours when the engine is destroyed or the process exits.
"""

from __future__ import annotations

import collections
import errno
import os
import re
import shutil
import socket
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch.profiler import record_function

from accelerate_zero.engine.shard_slice import ShardSlice


if TYPE_CHECKING:
    from accelerate_zero.engine.stores import SliceStepper

FILE_READ, FILE_WRITE = "ZeRO::file_read", "ZeRO::file_write"
"""Profiler ranges around every swap-file read and write (the file I/O lane of bench/gpu_compare_worker.py)."""

# exp_avg and exp_avg_sq for Adam-like optimizers: the most any torch optimizer keeps per element.
_STATES_PER_ELEMENT = 2


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, for raw file reads and writes (nothing is pickled)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def read_at(path: Path, byte_offset: int, target: torch.Tensor) -> None:
    """Fills `target` with the raw bytes of `path` from `byte_offset` (swap files: parameter shards, gradients).

    Raises:
        OSError: the file ends before `target` is full (truncated while the job ran: the rest of `target` would be
            whatever memory held before, so it is never returned).
    """
    nbytes = target.numel() * target.element_size()
    with record_function(FILE_READ), open(path, "rb") as file:
        file.seek(byte_offset)
        got = file.readinto(tensor_bytes(target))
    if got != nbytes:
        raise OSError(
            errno.EIO,
            f"{socket.gethostname()}: {path} holds {got or 0:,} of the {nbytes:,} bytes expected at byte {byte_offset:,}:"
            " the file was truncated or replaced while the job ran; offload files are only valid for the job that"
            " wrote them",
        )


def write_at(path: Path, byte_offset: int, values: torch.Tensor) -> None:
    """Writes the raw bytes of `values` into the existing file `path` at `byte_offset`."""
    try:
        with record_function(FILE_WRITE), open(path, "r+b") as file:
            file.seek(byte_offset)
            file.write(tensor_bytes(values))
    except OSError as error:
        raise write_error(path, values.numel() * values.element_size(), error) from error


def write_error(path: Path, nbytes: int, error: OSError) -> OSError:
    """`error` restated with the file and the bytes being written (a full disk otherwise names neither)."""
    hint = ": free space on that disk or point nvme_path elsewhere" if error.errno == errno.ENOSPC else ""
    return OSError(error.errno, f"{socket.gethostname()}: writing {nbytes:,} bytes to {path} failed: {error}{hint}")


def rank_folder(nvme_path: str, rank: int) -> Path:
    return Path(nvme_path) / "accelerate_zero" / f"rank{rank:05d}"


def check_nvme_path(
    nvme_path: str,
    rank: int,
    numel: int,
    grad_numel: int = 0,
    *,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Creates this rank's optimizer folder (removing stale files) and checks it is writable and has room for
    `numel` fp32 masters with their optimizer state and `grad_numel` fp32 gradients, and that the file system
    has room for every rank that uses it (ranks on one node share a disk); every rank must call it.

    Args:
        world_size: ranks of the job (rank folders at or above it are stale and not counted).
        barrier: waits for every rank (engine/collectives.py); None: this rank is alone.

    Raises:
        OSError: naming the host, the path, the bytes needed and the bytes free.
    """
    key = "offload_optimizer.nvme_path"
    needed = 4 * numel * (1 + _STATES_PER_ELEMENT) + 4 * grad_numel
    what = "its fp32 master weights, optimizer state" + (" and gradients" if grad_numel else "")
    folder = check_folder(key, nvme_path, rank_folder(nvme_path, rank), rank, needed, what)
    if barrier is not None:
        check_shared_space(key, nvme_path, folder, needed, world_size, barrier)
    return folder


_NEED_FILE = ".bytes_needed"


def check_shared_space(
    key: str, nvme_path: str, folder: Path, needed: int, world_size: int, barrier: Callable[[], None]
) -> None:
    """Sums what every rank folder under `nvme_path` needs (a file-based tally: the ranks that see a folder share
    its file system) and checks the file system holds it all.

    Raises:
        OSError: naming the host, the path, the ranks, the bytes they need together and the bytes free.
    """
    (folder / _NEED_FILE).write_text(str(needed))
    barrier()
    needs = {}
    for sibling in folder.parent.glob("rank*"):
        match = re.fullmatch(r"rank(\d+)", sibling.name)
        need_file = sibling / _NEED_FILE
        if match and int(match[1]) < world_size and need_file.is_file():
            needs[int(match[1])] = int(need_file.read_text())
    total, free = sum(needs.values()), shutil.disk_usage(folder).free
    if len(needs) > 1 and free < total:
        raise OSError(
            errno.ENOSPC,
            f"{socket.gethostname()}: {key}={nvme_path!r} has {free:,} bytes free but the {len(needs)} ranks using "
            f"it ({', '.join(map(str, sorted(needs)))}) need {total:,} bytes together: free space, point the "
            "ranks at other disks, or run fewer ranks per node",
        )


def check_folder(key: str, nvme_path: str, folder: Path, rank: int, needed: int, what: str) -> Path:
    """Creates `folder` under `nvme_path` (removing stale files) and checks it is writable and has `needed` bytes.

    Raises:
        OSError: naming the host, the key and path, the bytes needed and the bytes free.
    """
    host = socket.gethostname()
    try:
        shutil.rmtree(folder, ignore_errors=True)  # files of an earlier job that did not end cleanly
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write_probe"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as error:
        raise OSError(
            f"{host}: {key}={nvme_path!r} is not a writable folder ({error}); create it on "
            "every node or point nvme_path at a local disk"
        ) from None
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise OSError(
            f"{host}: {key}={nvme_path!r} has {free:,} bytes free but rank {rank} needs "
            f"{needed:,} bytes for {what}; free space or use another path"
        )
    return folder


class NvmeSwapper:
    """Steps the optimizer sub-group by sub-group from files (see the module docstring)."""

    on_host = True

    def __init__(
        self,
        folder: Path,
        slices_by_group: list[list[ShardSlice]],
        sub_group_numel: int,
        buffer_count: int,
        values: Callable[[ShardSlice], torch.Tensor],
    ) -> None:
        """`values` gives a slice's parameter values, which the masters start from (the shard may be in a file)."""
        self.folder, self.buffer_count = folder, max(2, buffer_count)
        entries = [(group, s) for group, slices in enumerate(slices_by_group) for s in slices]
        self.subgroups: list[list[tuple[int, ShardSlice]]] = []
        for entry in entries:
            size = entry[1].end - entry[1].start
            if self.subgroups and sum(s.end - s.start for _, s in self.subgroups[-1]) + size <= sub_group_numel:
                self.subgroups[-1].append(entry)
            else:
                self.subgroups.append([entry])
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="accelerate_zero_nvme")
        self.peak_resident = 0
        """Most sub-groups in memory at once during a step (the current, the one read ahead, writes in flight)."""
        for index, subgroup in enumerate(self.subgroups):
            for _, shard_slice in subgroup:  # the masters start as placeholders (offload_masters)
                shard_slice.master.data = values(shard_slice).detach().to(device="cpu", dtype=torch.float32, copy=True)
            save_file(_tensors(subgroup, {}), str(self._file(index)))
            _release(subgroup)
        self._finalizer = weakref.finalize(self, shutil.rmtree, folder, True)

    def _file(self, index: int) -> Path:
        return self.folder / f"subgroup{index:05d}.safetensors"

    def _write(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        partial = self.folder / f".subgroup{index:05d}.partial"
        try:
            with record_function(FILE_WRITE):
                save_file(tensors, str(partial))
        except OSError as error:
            raise write_error(partial, sum(t.numel() * t.element_size() for t in tensors.values()), error) from error
        os.replace(partial, self._file(index))

    def step(self, sharded: SliceStepper, coefficient: float) -> None:
        """One optimizer step over every sub-group, reading ahead and writing behind."""
        self.step_where(sharded, coefficient, None)

    def step_where(self, sharded: SliceStepper, coefficient: float, keep: Callable[[ShardSlice], bool] | None) -> None:
        """Steps the slices `keep` accepts (None: all): the sub-groups holding one are read, stepped (those slices
        only) and written back whole; the others are not read."""
        optimizer = sharded.optimizer
        kept = [[keep is None or keep(s) for _, s in subgroup] for subgroup in self.subgroups]
        order = [index for index, flags in enumerate(kept) if any(flags)]
        if not order:
            return
        all_params = [group["params"] for group in optimizer.param_groups]
        writes: collections.deque[Future] = collections.deque()
        reading = self._pool.submit(self._read_for_step, order[0])
        try:
            for position, index in enumerate(order):
                subgroup, flags = self.subgroups[index], kept[index]
                loaded, grads = reading.result()
                while len(writes) + 2 > self.buffer_count:  # current + read-ahead + writes in flight
                    writes.popleft().result()
                ahead = position + 1 < len(order)
                if ahead:
                    reading = self._pool.submit(self._read_for_step, order[position + 1])
                self.peak_resident = max(self.peak_resident, len(writes) + 1 + int(ahead))
                _restore(subgroup, loaded, optimizer)
                stepped = [(g, s) for (g, s), flag in zip(subgroup, flags, strict=True) if flag]
                for group_index, group in enumerate(optimizer.param_groups):
                    group["params"] = [s.master for g, s in stepped if g == group_index]
                grads = [grad for grad, flag in zip(grads, flags, strict=True) if flag]
                sharded.step_slices([s for _, s in stepped], coefficient, grads)
                tensors = _tensors(subgroup, optimizer.state)
                _release(subgroup, optimizer.state)
                writes.append(self._pool.submit(self._write, index, tensors))
        finally:
            for group, params in zip(optimizer.param_groups, all_params, strict=True):
                group["params"] = params
            for write in writes:
                write.result()

    def _read_for_step(self, index: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """A sub-group's masters and optimizer state, and its gradient slices (read from their file when the
        gradients were swapped too: offload/nvme_grads.py)."""
        subgroup = self.subgroups[index]
        with record_function(FILE_READ):
            loaded = load_file(str(self._file(index)))
        return loaded, [s.bucket.reduced_slice(s.start, s.end) for _, s in subgroup]

    def each_resident(self, optimizer: torch.optim.Optimizer, write_back: bool) -> Iterator[list[ShardSlice]]:
        """Brings one sub-group at a time into memory (masters and optimizer state) and yields its slices;
        with `write_back` what the caller changed is written to the file before the next (checkpoints)."""
        for index, subgroup in enumerate(self.subgroups):
            _restore(subgroup, load_file(str(self._file(index))), optimizer)
            try:
                yield [shard_slice for _, shard_slice in subgroup]
                if write_back:
                    self._write(index, _tensors(subgroup, optimizer.state))
            finally:
                _release(subgroup, optimizer.state)

    def file_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.folder.glob("subgroup*.safetensors"))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._finalizer()


def _key(index: int, kind: str) -> str:
    return f"{index}/{kind}"


def _tensors(subgroup: list[tuple[int, ShardSlice]], state: dict) -> dict[str, torch.Tensor]:
    out = {}
    for index, (_, shard_slice) in enumerate(subgroup):
        out[_key(index, "master")] = shard_slice.master.detach().clone()
        for kind, value in state.get(shard_slice.master, {}).items():
            if torch.is_tensor(value):
                out[_key(index, kind)] = value.detach().clone()
    return out


def _restore(
    subgroup: list[tuple[int, ShardSlice]], loaded: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    for index, (_, shard_slice) in enumerate(subgroup):
        shard_slice.master.data = loaded[_key(index, "master")]
        state = {key.split("/", 1)[1]: value for key, value in loaded.items() if key.startswith(f"{index}/")}
        state.pop("master")
        if state:
            optimizer.state[shard_slice.master] = state


def _release(subgroup: list[tuple[int, ShardSlice]], state: dict | None = None) -> None:
    for _, shard_slice in subgroup:
        shard_slice.master.data = torch.empty(0)
        if state is not None:
            state.pop(shard_slice.master, None)
