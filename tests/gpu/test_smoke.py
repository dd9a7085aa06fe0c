"""tests/gpu/smoke.py's checks: on 2 gloo ranks on the CPU (so the suite keeps the GPU smoke test alive), and on a
machine with CUDA under torchrun on every local GPU (the `gpu` marker: skipped where there is no CUDA device).

On CUDA the same checks run on NCCL, plus the CUDA-only ones (device binding, the device memory a checkpoint save
allocates, host syncs per step, memory per phase, CUDA contexts). `pytest tests/gpu` on a GPU machine runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    "device bytes allocated asleep",
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


@pytest.mark.gpu
def test_every_smoke_check_passes_on_every_local_gpu(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "smoke.json"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torch.cuda.device_count()}"]
    command += [str(repo / "tests" / "gpu" / "smoke.py"), "--out", str(out), "--workdir", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    failed = {name: value for name, (value, ok) in results.items() if not ok}
    assert not failed and len(results) >= 40, failed or sorted(results)
    assert not [name for name, (value, _) in results.items() if value == SKIPPED], "a CUDA check was skipped on CUDA"
