"""HostCopies: copies between the compute device and host memory that do not stop Python.

[Note: asynchronous host copies]
Under offload every reduced gradient slice goes to host memory and offloaded parameter shards come back. A blocking
copy on the compute stream (`tensor.to("cpu")`) stops Python until every kernel queued before it has run: inside a
backward hook that is a stall per bucket. Here a copy runs on one side stream per device, ordered after the work
that produced its source by an event, and returns a `CopyDone`. The rules every caller keeps:
1. A copy's destination is read (or written) by the host only after `CopyDone.wait()`.
2. A device source lives until its copy completes: it is recorded on the side stream, so the caching allocator
   does not hand its memory out again before that.
3. A host buffer that is the source of a copy in flight is not written by the host until the copy completes
   (`drain()` before an optimizer step writes offloaded shards or masters).
4. A device destination is used on the compute stream only after the compute stream waited for the copy
   (`to_device` makes it wait before returning: later kernels wait for the copy, earlier ones do not).
On devices without streams (CPU, where every copy is host to host) each copy is synchronous and `wait()` returns at
once, so the same bookkeeping runs under gloo in CI. `copies` and `bytes` count what went through (tests assert one
copy per bucket per step).

[Note: the host is the device]
When the compute device is the CPU, "host memory" and "device memory" are the same memory: a reduced gradient slice
bound for the host can be scaled and added where it lands in one pass (`fold_into_host`), as a device-resident
gradient is, instead of scaled in place, copied, staged and added (three to four passes over the slice).
`host_is_device` says which path a caller takes; a test double modelling a device with memory of its own
(tests/distributed/test_host_copies.py) says False, so the asynchronous path and its rules stay exercised on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from accelerate_zero.engine.kept_grads import fold_into


TO_HOST, TO_DEVICE = "ZeRO::copy_to_host", "ZeRO::copy_to_device"
"""Profiler ranges around every copy issued here (on a GPU they cover issuing it; the copy itself is the profiler's
memcpy event). bench/gpu_compare_worker.py draws them as lanes."""


class CopyDone:
    """Completion of one copy; `wait()` before the host touches its destination (or writes its host source)."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def done(self) -> bool:
        return self._event is None or self._event.query()


class HostCopies:
    """One side stream per compute device for copies to and from host memory (see the note above)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last_on_current: torch.cuda.Event | None = None
        self._side_used = False  # a copy was issued on the side stream since the last drain()
        self.copies = 0
        self.bytes = 0

    @property
    def asynchronous(self) -> bool:
        return self._side is not None

    @property
    def host_is_device(self) -> bool:
        """The compute device's memory is host memory ([Note: the host is the device])."""
        return self.device.type == "cpu"

    def fold_into_host(self, source: torch.Tensor, destination: torch.Tensor, scale: float, fresh: bool) -> None:
        """`destination` = (`fresh`) or += `source * scale`, in one pass; only when `host_is_device`."""
        assert self.host_is_device, "fold_into_host() needs the host to be the device: use to_host()"
        self._count(source)
        fold_into(destination, source, scale, fresh)

    def _count(self, tensor: torch.Tensor) -> None:
        self.copies += 1
        self.bytes += tensor.numel() * tensor.element_size()

    def to_host(self, source: torch.Tensor, destination: torch.Tensor) -> CopyDone:
        """Copies device `source` into host `destination` (page-locked for the copy to be asynchronous)."""
        self._count(source)
        with record_function(TO_HOST):
            return self._to_host(source, destination)

    def _to_host(self, source: torch.Tensor, destination: torch.Tensor) -> CopyDone:
        if self._side is None:
            destination.copy_(source)
            return CopyDone()
        produced = torch.cuda.current_stream(self.device).record_event()
        self._side.wait_event(produced)
        self._side_used = True
        with torch.cuda.stream(self._side):
            destination.copy_(source, non_blocking=True)
        source.record_stream(self._side)
        return CopyDone(self._side.record_event())

    def to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        """A device copy of host `source`, usable on the current stream at once; the `CopyDone` says when `source`
        may be written again. Already on the device: returned as is."""
        if source.device == self.device or (source.device.type == self.device.type == "cpu"):
            return source, CopyDone()
        self._count(source)
        with record_function(TO_DEVICE):
            return self._to_device(source)

    def _to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        if self._side is None:
            return source.to(self.device), CopyDone()
        self._side_used = True
        with torch.cuda.stream(self._side):
            copied = source.to(self.device, non_blocking=True)
            done = self._side.record_event()
        # The copy was allocated on the side stream; the compute stream uses it after waiting for the copy.
        torch.cuda.current_stream(self.device).wait_event(done)
        copied.record_stream(torch.cuda.current_stream(self.device))
        return copied, CopyDone(done)

    def into_device(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copies host `source` into the existing device tensor `destination` without stopping Python.

        Runs on the current stream: `destination` is the compute stream's own tensor (a parameter shard) and its
        next reader, so the order is kept without events. `drain()` waits for it before `source` is written."""
        if source.device == destination.device:
            destination.copy_(source)
            return
        self._count(source)
        with record_function(TO_DEVICE):
            destination.copy_(source, non_blocking=self._side is not None)
        if self._side is None:
            return
        self._last_on_current = torch.cuda.current_stream(self.device).record_event()

    def to_host_in_worker(self, source: torch.Tensor) -> Callable[[], torch.Tensor]:
        """For a worker thread: a function returning a host copy of device `source` (`source` itself when it is
        in host memory already). The copy is ordered after the work queued now and blocks only the worker;
        `source` must not be written until the function returned (the caller hands over a private tensor)."""
        self._count(source)
        if self._side is None:
            return lambda: _labelled_cpu(source)
        produced = torch.cuda.current_stream(self.device).record_event()
        side = self._side
        self._side_used = True

        def fetch() -> torch.Tensor:
            # A new thread's current device is cuda:0: entering the stream alone would first query that device's
            # stream, creating a context on GPU 0 for every rank (refused outright on exclusive-mode GPUs).
            with torch.cuda.device(side.device), torch.cuda.stream(side):  # the worker's current stream
                side.wait_event(produced)
                return _labelled_cpu(source)

        return fetch

    def drain(self) -> None:
        """Waits for every copy issued so far (host buffers they read or write are then free to touch)."""
        if self._side is not None and self._side_used:  # an idle stream needs no wait (a host sync per step)
            self._side.synchronize()
            self._side_used = False
        if self._last_on_current is not None:
            self._last_on_current.synchronize()
            self._last_on_current = None


def _labelled_cpu(source: torch.Tensor) -> torch.Tensor:
    with record_function(TO_HOST):
        return source.cpu()
