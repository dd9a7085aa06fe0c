"""Device binding on a GPU machine, checked on the CPU with torch.cuda's queries patched (issue: the first 8-GPU
run). What cannot be checked without CUDA (NCCL's `device_id`) is in tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.groups import resolve_device


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    bound: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: bound.append(torch.device(device)))
    return bound


@pytest.mark.parametrize("given", [None, "cuda", torch.device("cuda")])
def test_the_local_rank_picks_and_binds_the_device(
    four_gpus: list[torch.device], monkeypatch: pytest.MonkeyPatch, given: object
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device(given) == torch.device("cuda", 3)
    assert four_gpus == [torch.device("cuda", 3)]


def test_an_explicit_index_is_kept_and_bound(four_gpus: list[torch.device], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert four_gpus == [torch.device("cuda", 1)]


def test_a_local_rank_beyond_the_visible_devices_is_refused(
    four_gpus: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=4 but this process sees 4 CUDA device\(s\).*0,1,2,3"):
        resolve_device(None)
    assert four_gpus == []


def test_the_cpu_is_never_bound(four_gpus: list[torch.device]) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert four_gpus == []


def test_the_only_visible_device_is_the_ranks_own(
    four_gpus: list[torch.device], monkeypatch: pytest.MonkeyPatch
) -> None:
    # SLURM with --gpus-per-task=1 (or a launcher setting CUDA_VISIBLE_DEVICES per rank): local rank 3 sees one GPU.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert resolve_device(None) == torch.device("cuda", 0)
    assert four_gpus == [torch.device("cuda", 0)]


def test_accelerates_cpu_device_is_the_cpu() -> None:
    # accelerate's device on a CPU run is "cpu:0": tensor.to("cpu:0") copies a tensor on "cpu" (a view stops being one)
    assert resolve_device(torch.device("cpu", 0)) == torch.device("cpu")
    flat = torch.zeros(4)
    assert flat.to(resolve_device("cpu:0")).data_ptr() == flat.data_ptr()
