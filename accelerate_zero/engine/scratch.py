"""ScratchBuffers: where the engine's full-size temporaries come from, and whether they are reused.

[Note: temporaries reused in host memory]
At stages 2 and 3 every micro-step fills a full-size gradient buffer per bucket and, on gloo, receives a full-size
copy of the partial sums in each reduce-scatter ([Note: reduce-scatter on gloo]); both are dropped once the bucket
is reduced. On CUDA, torch's caching allocator hands the same blocks to the next bucket. In host memory nothing
does: the C allocator serves a large block (glibc: above its mmap threshold, 32 MiB at most) with fresh pages every
time, which the kernel faults in and zeroes on first touch, a pass over the buffer that DDP, whose buckets live for
the whole run, does not pay. So on the CPU device the engine keeps these buffers when they are given back and hands
them out again to a request of the same size and dtype within one backward (units of the same size reduce one after
the other). What it keeps is at most what was in use at once (like CUDA's reserved memory), reported by
`memory_breakdown()` as `cached_buffers` apart from the bytes held for training state. Host memory has no streams: a
buffer given back is no longer read or written by anything (collectives on gloo are waited for before their buffers
are given back). On any other device `take` allocates and `give` drops the reference: the device's allocator does
the caching, and knows the streams.

[Note: nothing but the gradient shard survives a micro-step]
The cache is dropped when every bucket of a backward is reduced (GradReducer `end_backward`), at every micro-step,
not only at the end of the accumulation cycle: between micro-steps the engine holds its shards, the optimizer state
and the gradient shard the micro-steps accumulate into, and nothing else. Kept across micro-steps, the cache sat
beside the next forward's activations and its gathered units, where accumulation 1 has none of it, so the peak grew
with `gradient_accumulation_steps` (issue 44, item 11; bench/README.md, stage3_bench.py). Each micro-step now pays
the first-touch faults that a step pays at accumulation 1, once per backward.

[Note: host temporaries in huge pages]
What each micro-step still pays is the kernel's: a fresh full-size buffer is faulted in and zeroed page by page on
first touch, 4 KiB at a time (a 132 MB stage-2 bucket: 33,000 faults, 40 ms of CPU time of a rank, measured with
bench/trainer_bench.py's fault count beside the CPU time; DDP's buckets live for the whole run and pay it once). A
large host temporary (`HUGE_PAGES_MIN_BYTES` and up) is therefore its own anonymous mapping advised to use
transparent huge pages (`madvise(MADV_HUGEPAGE)`: used where the kernel's setting is "madvise" or "always"): the
same bytes are zeroed, in 2 MiB pages, which cost about a third of the time (copying into a fresh 132 MB buffer:
62 ms with 4 KiB pages, 35 ms in huge pages, 21 ms into a warm one). Nothing else changes: the mapping is unmapped
when the last tensor viewing it is freed, as a large `torch.empty` is, and counts in RSS once written. Where the
platform has no such advice the buffer is a plain `torch.empty`.
"""

from __future__ import annotations

import mmap

import torch


HUGE_PAGES_MIN_BYTES = 8 << 20
"""Host temporaries from this size up are allocated in huge pages ([Note: host temporaries in huge pages])."""


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1D tensor in host memory; from `HUGE_PAGES_MIN_BYTES` up, in its own mapping advised to use
    transparent huge pages ([Note: host temporaries in huge pages])."""
    nbytes = numel * dtype.itemsize
    advice, anonymous = getattr(mmap, "MADV_HUGEPAGE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes < HUGE_PAGES_MIN_BYTES or advice is None or anonymous is None:
        return torch.empty(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | anonymous)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without transparent huge pages: plain pages, as torch.empty would give
        pass
    return torch.frombuffer(region, dtype=dtype, count=numel)


def device_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1D temporary on `device` (in host memory: `host_empty`)."""
    if device.type == "cpu":
        return host_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


class ScratchBuffers:
    """Hands out 1D temporaries; on the CPU device keeps the ones given back for reuse (see the note above)."""

    def __init__(self, device: torch.device, reuse: bool | None = None) -> None:
        """`reuse`: keep buffers given back; default: on the CPU device only."""
        self.device = torch.device(device)
        self.reuses = self.device.type == "cpu" if reuse is None else reuse
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.allocations = 0
        """Buffers `take` allocated rather than reused, since the engine started."""

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1D tensor of `numel` elements on the device."""
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        self.allocations += 1
        return device_empty(numel, dtype, self.device)

    def give(self, tensor: torch.Tensor) -> None:
        """Takes back a tensor from `take` that nothing uses any more (nor will: it may be handed out again)."""
        if self.reuses:
            free = self._free.setdefault((tensor.numel(), tensor.dtype), [])
            assert all(kept is not tensor for kept in free), "a scratch buffer was given back twice"
            free.append(tensor)

    def drop(self, numel: int, dtype: torch.dtype) -> None:
        """Drops the kept buffers of one size (no request of that size is coming)."""
        self._free.pop((numel, dtype), None)

    def cached_tensors(self) -> list[torch.Tensor]:
        """The buffers kept for reuse (for memory accounting)."""
        return [t for free in self._free.values() for t in free]

    def clear(self) -> None:
        """Drops every kept buffer (the memory goes back to the allocator)."""
        self._free.clear()
