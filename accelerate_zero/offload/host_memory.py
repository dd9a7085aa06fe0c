"""HostMemory: the engine's page-locked host buffers, pinned at their size (not rounded up to a power of two).

[Note: pinned memory at its size]
Offloaded state lives in host memory that a GPU copies to and from; page-locked ("pinned") memory lets those
copies run asynchronously. torch's pinned allocator (`pin_memory=True`) caches blocks and rounds every request up to
the next power of two, so a 35 GB master buffer would pin 64 GB of every rank's host memory. Here host memory is
taken in chunks of at most `chunk_bytes` (256 MiB) of ordinary memory, each page-locked in place with
`cudaHostRegister` at its exact size, and buffers are cut from the chunks one after the other (a buffer larger than a
chunk gets a chunk of its own size). The waste is the unused tail of each chunk: at most one buffer's size per chunk,
never a doubling. The chunks stay registered until `close()` (the engine's `destroy()`), which unregisters them
before their memory can be freed. Where pinning is off or impossible (a CPU-only machine, `pin_memory: false`, a
registration the driver refuses), buffers are ordinary host tensors: copies are then synchronous but correct.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch


logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 2**20
_ALIGN_BYTES = 64  # every buffer starts on a 64-byte boundary (any dtype, vectorised CPU kernels)


def _cuda_register(pointer: int, size: int) -> bool:
    if int(torch.cuda.cudart().cudaHostRegister(pointer, size, 0)) == 0:
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """Consumes the CUDA runtime's last error. A refused cudaHostRegister leaves its error behind, and torch checks
    `cudaGetLastError()` after every kernel launch: the next unrelated kernel would fail with it. torch does not
    bind cudaGetLastError, so it is called in the CUDA runtime torch already loaded."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:  # not Linux: nothing to find it by
        return
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()


def _cuda_unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


class HostMemory:
    """Cuts host buffers out of pinned chunks (see the note above)."""

    def __init__(
        self,
        pin: bool,
        chunk_bytes: int = CHUNK_BYTES,
        register: Callable[[int, int], bool] = _cuda_register,
        unregister: Callable[[int], None] = _cuda_unregister,
    ) -> None:
        """`pin`: page-lock the buffers (only useful, and only possible, when a GPU copies from them). `register` /
        `unregister` page-lock and release a range (cudaHostRegister; replaceable in tests)."""
        self.pin, self.chunk_bytes = pin, chunk_bytes
        self._register, self._unregister = register, unregister
        self.chunks: list[torch.Tensor] = []  # uint8, registered
        self._used = 0  # bytes of the last chunk handed out
        self.requested_bytes = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(chunk.numel() for chunk in self.chunks)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.empty(numel, dtype)
        return buffer.zero_()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin or numel == 0:
            return torch.empty(numel, dtype=dtype)
        size = numel * torch.empty((), dtype=dtype).element_size()
        self.requested_bytes += size
        start = -(-self._used // _ALIGN_BYTES) * _ALIGN_BYTES
        if not self.chunks or start + size > self.chunks[-1].numel():
            chunk = self._new_chunk(max(size, self.chunk_bytes))
            if chunk is None:
                return torch.empty(numel, dtype=dtype)
            start = 0
        self._used = start + size
        return self.chunks[-1][start : start + size].view(dtype)

    def _new_chunk(self, size: int) -> torch.Tensor | None:
        chunk = torch.empty(size, dtype=torch.uint8)
        if not self._register(chunk.data_ptr(), size):
            logger.warning(
                "accelerate_zero: could not page-lock %d MiB of host memory (cudaHostRegister refused it); offloaded "
                "state stays in ordinary memory and its copies are synchronous",
                size >> 20,
            )
            self.pin = False
            return None
        self.chunks.append(chunk)
        return chunk

    def close(self) -> None:
        """Unregisters every chunk (buffers cut from them stay valid as ordinary memory)."""
        for chunk in self.chunks:
            self._unregister(chunk.data_ptr())
        self.chunks.clear()
        self._used = 0


def _pretend_registered(pointer: int, size: int) -> bool:
    return True


def _pretend_unregistered(pointer: int) -> None:
    pass


class ChunkedHostMemory(HostMemory):
    """The pinned layout without a GPU: buffers cut from shared chunks on a CPU-only machine, nothing page-locked.

    The engine takes `HostMemory(pin=False)` on the CPU, where every buffer is a tensor of its own; on a GPU its
    buffers share chunks, and what that forbids (freeing one buffer's storage frees the chunk under all the others)
    would only show there. Tests build the engine with this class so that CPU runs obey the GPU's rules."""

    def __init__(self, pin: bool = True, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(True, chunk_bytes, register=_pretend_registered, unregister=_pretend_unregistered)
