"""[Note: threads for host work]: the offloaded step of a GPU rank uses the rank's cores, not the launcher's one."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.config import ZeroConfig
from accelerate_zero.offload.host_threads import THREADS_ENV, HostThreads, host_threads_for, threads_for_rank


def test_an_unbound_rank_takes_its_share_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    cores = set(range(16))
    assert threads_for_rank({"LOCAL_WORLD_SIZE": "8"}, cores) == 2
    assert threads_for_rank({"LOCAL_WORLD_SIZE": "1"}, cores) == 16
    assert threads_for_rank({}, cores) == 16
    assert threads_for_rank({"LOCAL_WORLD_SIZE": "32"}, cores) == 1


def test_a_bound_rank_uses_all_of_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert threads_for_rank({"LOCAL_WORLD_SIZE": "8"}, {4, 5, 6, 7}) == 4


def test_the_variable_decides_and_a_bad_value_is_refused_by_name() -> None:
    assert threads_for_rank({THREADS_ENV: "3", "LOCAL_WORLD_SIZE": "8"}, set(range(16))) == 3
    for bad in ("0", "many", "-2"):
        with pytest.raises(ValueError, match=rf"{THREADS_ENV}='{bad}' is not a positive number of threads"):
            threads_for_rank({THREADS_ENV: bad})


def test_threads_are_raised_inside_the_step_only_and_never_lowered() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with HostThreads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        with HostThreads(1):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cpuadam_cores_perc_takes_its_share_of_the_ranks_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's `offload_optimizer.cpuadam_cores_perc` is honoured: a share of the rank's own cores (at least
    one); unset, all of them; the variable still decides when set."""
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    cores = set(range(16))
    assert threads_for_rank({"LOCAL_WORLD_SIZE": "2"}, cores, share=0.75) == 6
    assert threads_for_rank({}, {4, 5, 6, 7}, share=0.5) == 2
    assert threads_for_rank({}, cores, share=0.0) == 1
    assert threads_for_rank({THREADS_ENV: "3"}, cores, share=0.5) == 3
    monkeypatch.setattr("accelerate_zero.offload.host_threads._affinity", lambda: cores)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for share, threads in ((None, 16), (0.8, 12)):
        config = ZeroConfig.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
        offload = config.zero_optimization.offload_optimizer
        assert offload.cpuadam_cores_perc is None
        if share is not None:
            raw = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": share}}}
            offload = ZeroConfig.from_any(raw).zero_optimization.offload_optimizer
        chosen = host_threads_for(torch.device("cuda", 0), True, offload.cpuadam_cores_perc)
        assert chosen is not None and chosen.threads == threads
    assert host_threads_for(torch.device("cpu"), True, 0.5) is None  # on a CPU device the host work is the training
    assert host_threads_for(torch.device("cuda", 0), False, 0.5) is None
