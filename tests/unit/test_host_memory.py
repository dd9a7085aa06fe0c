"""HostMemory pins host buffers at their size: chunks registered exactly, buffers cut from them without overlap,
everything unregistered on close, and a refused registration falls back to ordinary memory with a warning.

cudaHostRegister needs a GPU; a recording double stands in for it (the CPU path the engine takes on this machine
is the `pin=False` case)."""

from __future__ import annotations

import logging

import pytest
import torch

from accelerate_zero.offload.host_memory import HostMemory


MiB = 2**20


class Registrar:
    def __init__(self, refuse: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.refuse = refuse
        self.unregistered: list[int] = []

    def register(self, pointer: int, size: int) -> bool:
        if self.refuse:
            return False
        assert pointer not in self.live, "a range registered twice"
        self.live[pointer] = size
        return True

    def unregister(self, pointer: int) -> None:
        assert pointer in self.live, "unregistering a range never registered"
        del self.live[pointer]
        self.unregistered.append(pointer)


def _memory(registrar: Registrar, chunk_bytes: int = 8 * MiB) -> HostMemory:
    return HostMemory(True, chunk_bytes, register=registrar.register, unregister=registrar.unregister)


def test_buffers_are_cut_from_exact_chunks_without_rounding_or_overlap() -> None:
    registrar = Registrar()
    memory = _memory(registrar)
    sizes = [3 * MiB // 4, 1 * MiB, 5 * MiB // 4, 20 * MiB // 4, 7, 2 * MiB // 4]  # float32 elements
    buffers = [memory.zeros(n, torch.float32) for n in sizes]
    half = memory.zeros(1000, torch.bfloat16)
    for buffer, n in zip(buffers, sizes, strict=True):
        assert buffer.numel() == n and buffer.dtype == torch.float32 and not buffer.any()
        assert buffer.data_ptr() % 64 == 0
    assert half.dtype == torch.bfloat16 and half.numel() == 1000
    # Each buffer lies in one registered chunk, and no two buffers share a byte.
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in [*buffers, half])
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    for start, end in spans:
        assert any(p <= start and end <= p + size for p, size in registrar.live.items())
    for i, buffer in enumerate(buffers):
        buffer.fill_(i + 1)
    assert [int(b[0].item()) for b in buffers] == list(range(1, len(buffers) + 1))
    # The 20 MiB buffer got a chunk of exactly its size (torch's pinned allocator would pin 32 MiB for it); the rest
    # share 8 MiB chunks. Pinned bytes: within one chunk tail per chunk of what was asked.
    assert 20 * MiB in registrar.live.values()
    assert all(size in (8 * MiB, 20 * MiB) for size in registrar.live.values())
    assert memory.pinned_bytes == sum(registrar.live.values())
    assert memory.pinned_bytes - memory.requested_bytes < 8 * MiB * len(registrar.live)


def test_a_buffer_larger_than_a_chunk_is_pinned_at_its_size() -> None:
    # The 35 GB master buffer of the issue, scaled down: 35 chunks and 12 bytes would be 64 chunks if rounded up.
    registrar = Registrar()
    memory = _memory(registrar, chunk_bytes=MiB)
    buffer = memory.empty((35 * MiB + 12) // 4, torch.float32)
    assert buffer.numel() * 4 == 35 * MiB + 12
    assert list(registrar.live.values()) == [35 * MiB + 12] and memory.pinned_bytes == memory.requested_bytes


def test_close_unregisters_every_chunk_once_and_buffers_stay_usable() -> None:
    registrar = Registrar()
    memory = _memory(registrar)
    kept = [memory.zeros(3 * MiB // 4, torch.float32) for _ in range(5)]
    assert len(registrar.live) == 3  # 3 MiB buffers, two per 8 MiB chunk
    memory.close()
    assert registrar.live == {} and len(registrar.unregistered) == 3
    kept[-1].fill_(2.0)
    assert kept[-1].sum().item() == 2.0 * kept[-1].numel()


def test_a_refused_registration_falls_back_to_ordinary_memory(caplog: pytest.LogCaptureFixture) -> None:
    registrar = Registrar(refuse=True)
    memory = _memory(registrar)
    with caplog.at_level(logging.WARNING):
        buffer = memory.zeros(100, torch.float32)
    assert buffer.numel() == 100 and not memory.pin and memory.chunks == []
    assert "could not page-lock" in caplog.text


def test_without_pinning_buffers_are_plain_host_tensors() -> None:
    memory = HostMemory(False)
    buffer = memory.zeros(10, torch.float32)
    assert buffer.device.type == "cpu" and not buffer.any() and memory.chunks == [] and memory.pinned_bytes == 0
