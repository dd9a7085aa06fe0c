"""Memory is counted per distinct storage: views and aliases once, under the first kind that names them."""

from __future__ import annotations

import torch

from accelerate_zero.debug.memory import bytes_by_kind
from accelerate_zero.offload.host_memory import ChunkedHostMemory


def test_views_and_aliases_count_once() -> None:
    flat = torch.zeros(100)
    other = torch.zeros(10, dtype=torch.float16)
    out = bytes_by_kind({"parameters": [flat[:50], flat[50:]], "master_weights": [flat[10:20]], "grads": [other]})
    assert out == {"parameters": 400, "master_weights": 0, "grads": 20, "total": 420}


def test_buffers_cut_from_a_shared_chunk_count_their_own_bytes_once() -> None:
    memory = ChunkedHostMemory(chunk_bytes=4096)
    shards, masters = memory.empty(100, torch.bfloat16), memory.empty(50, torch.float32)
    assert shards.untyped_storage().data_ptr() == masters.untyped_storage().data_ptr(), "one chunk holds both"
    kinds = {
        "host_parameters": [shards],
        "host_master_weights": [masters[:20], masters[20:], masters[10:30]],  # pieces and an overlapping view
        "host_gradients": [shards[:10]],  # already counted as parameters
    }
    out = bytes_by_kind(kinds, memory.chunks)
    assert out == {"host_parameters": 200, "host_master_weights": 200, "host_gradients": 0, "total": 400}
    # Without naming the chunks, the whole chunk is counted under the first kind (what the engine reported before).
    assert bytes_by_kind(kinds)["host_parameters"] == 4096
