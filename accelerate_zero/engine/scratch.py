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
"""

from __future__ import annotations

import torch


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
        return torch.empty(numel, dtype=dtype, device=self.device)

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
