"""ScratchBuffers ([Note: temporaries reused in host memory] in engine/scratch.py): on the CPU device a buffer given
back is handed out again to a request of the same size and dtype, and to nothing else; elsewhere (and with
`reuse=False`) every request allocates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accelerate_zero.engine.scratch import HUGE_PAGES_MIN_BYTES, ScratchBuffers


def test_a_buffer_given_back_serves_the_next_request_of_its_size_and_dtype() -> None:
    scratch = ScratchBuffers(torch.device("cpu"))
    first = scratch.take(1000, torch.float32)
    scratch.give(first)
    assert scratch.cached_tensors() == [first]
    other_size, other_dtype = scratch.take(999, torch.float32), scratch.take(1000, torch.bfloat16)
    assert first.data_ptr() not in (other_size.data_ptr(), other_dtype.data_ptr())
    again = scratch.take(1000, torch.float32)
    assert again.data_ptr() == first.data_ptr()
    assert scratch.cached_tensors() == []
    assert scratch.allocations == 3


def test_two_buffers_of_one_size_in_use_at_once_are_distinct_and_both_kept() -> None:
    scratch = ScratchBuffers(torch.device("cpu"))
    a, b = scratch.take(64, torch.float32), scratch.take(64, torch.float32)
    scratch.give(a)
    scratch.give(b)
    reused = {scratch.take(64, torch.float32).data_ptr() for _ in range(2)}
    assert reused == {a.data_ptr(), b.data_ptr()}
    assert scratch.allocations == 2


def test_without_reuse_every_request_allocates_and_nothing_is_kept() -> None:
    scratch = ScratchBuffers(torch.device("cpu"), reuse=False)
    first = scratch.take(1000, torch.float32)
    scratch.give(first)
    assert scratch.cached_tensors() == []
    scratch.take(1000, torch.float32)
    assert scratch.allocations == 2


def test_other_devices_leave_reuse_to_their_allocator() -> None:
    assert not ScratchBuffers(torch.device("cuda", 0)).reuses  # constructing allocates nothing: no GPU needed
    assert ScratchBuffers(torch.device("cpu")).reuses


def test_clear_drops_what_is_kept_and_a_double_give_is_refused() -> None:
    scratch = ScratchBuffers(torch.device("cpu"))
    buffer = scratch.take(10, torch.float32)
    scratch.give(buffer)
    with pytest.raises(AssertionError, match="given back twice"):
        scratch.give(buffer)
    scratch.clear()
    assert scratch.cached_tensors() == []


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping holding `address` (its fields), or None."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                if entry is not None:
                    return entry
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                entry = {} if lo <= address < hi else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key.strip()] = value.strip()
    return entry


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_a_large_host_temporary_is_its_own_mapping_advised_huge_pages_and_freed_with_its_tensor() -> None:
    # [Note: host temporaries in huge pages]: large temporaries in huge pages, small ones from the allocator.
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    scratch = ScratchBuffers(torch.device("cpu"))
    large = scratch.take(HUGE_PAGES_MIN_BYTES // 4, torch.float32)
    large.fill_(1.5)
    assert large.shape == (HUGE_PAGES_MIN_BYTES // 4,) and large.dtype == torch.float32
    assert large.sum().item() == 1.5 * large.numel()
    mapping = _mapping_of(large.data_ptr())
    assert mapping is not None
    if thp.exists() and "[never]" not in thp.read_text():
        assert mapping.get("THPeligible") == "1", mapping
        assert "hg" in mapping.get("VmFlags", "").split(), mapping  # madvise(MADV_HUGEPAGE)
    small = scratch.take(1000, torch.float32)
    small_mapping = _mapping_of(small.data_ptr())
    assert small_mapping is None or "hg" not in small_mapping.get("VmFlags", "").split()
    address = large.data_ptr()
    del large
    assert _mapping_of(address) is None  # unmapped with its last tensor
