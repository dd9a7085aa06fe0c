"""tests/gpu/smoke.py's checks on 2 gloo ranks on the CPU, so the suite keeps the GPU smoke test alive.

On a machine with GPUs run the script itself (its docstring has the command): the same checks on CUDA/NCCL, plus
the CUDA-only ones (device binding, the device memory a checkpoint save allocates, host syncs per step).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.smoke import SKIPPED, run_all
from tests.helpers.dist import run_distributed


CUDA_ONLY = (
    "device bound without set_device",
    "host syncs per step",
    "device bytes the save allocated",
    "peak MiB per phase",
    "allocated between steps",
    "CUDA contexts",
    "a refused cudaHostRegister",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA run tests/gpu/smoke.py under a launcher")
def test_every_smoke_check_passes_on_two_cpu_ranks(tmp_path: Path) -> None:
    by_rank = run_distributed(run_all, 2, str(tmp_path))
    for rank, results in enumerate(by_rank):
        failed = {name: value for name, (value, ok) in results.items() if not ok}
        assert not failed, f"rank {rank}: {failed}"
        assert len(results) >= 20, sorted(results)
        for name, (value, _) in results.items():
            assert (value == SKIPPED) == any(part in name for part in CUDA_ONLY), name  # on the CPU exactly these
