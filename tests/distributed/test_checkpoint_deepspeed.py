"""DeepSpeed's checkpoints resumed by our engines ([Note: DeepSpeed's ZeRO layouts] in
accelerate_zero/checkpoint/deepspeed_read.py, [Note: DeepSpeed's universal layout] in deepspeed_universal.py).

On 2 and on 3 gloo ranks, DeepSpeed 0.19.8 itself (tests/distributed/deepspeed_runs.py) trains a tiny Llama with
AdamW (weight decay) and a linear WarmupLR at ZeRO stages 1, 2 and 3 for 2 steps, saves (`global_step2`, `latest`),
trains 2 more and saves again: the run that never moved, its final fp32 masters consolidated by DeepSpeed's own
zero_to_fp32. Our engines at stages 1, 2 and 3 then `load_checkpoint(folder)` and train the same 2 steps: the
weights must match DeepSpeed's within 1e-5, with its step count and learning rate; the 3-rank group also resumes
the 2-rank folders (another world size) and ds_to_universal's conversion of one. Everything runs in one pooled
body per world size (importing deepspeed costs seconds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import run_distributed


TOLERANCE = 1e-5


def _resume(rank: int, world_size: int, folder: Path, stage: int, **load: Any) -> dict[str, Any]:
    from tests.distributed import deepspeed_runs as runs

    engine = runs.ours(world_size, stage)
    loaded, _ = engine.load_checkpoint(str(folder), **load)
    out = {"loaded": Path(loaded).name, "steps_loaded": engine.global_steps}
    runs.train(engine, range(runs.SAVED_AT, runs.STEPS), rank, world_size)
    out |= {"state": runs.full_state(engine), "lr": engine.get_lr()[0], "steps": engine.global_steps}
    return out


def _body(rank: int, world_size: int, root: str, other: str | None) -> dict[str, Any]:
    from tests.distributed import deepspeed_runs as runs

    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        folder = Path(root) / f"ds_w{world_size}_z{stage}"
        ran = runs.deepspeed_run(rank, world_size, folder, stage)
        reference = runs.deepspeed_masters(folder, runs.FINAL) if rank == 0 else None
        for ours in (1, 2, 3):
            got = _resume(rank, world_size, folder, ours)
            diff = runs.max_diff(got.pop("state"), reference) if rank == 0 else None
            out[(stage, ours)] = {**got, "diff": diff, "reference_lr": ran["lr"], "reference_steps": ran["steps"]}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list]:
    root = tmp_path_factory.mktemp("deepspeed")
    two = run_distributed(_body, 2, str(root), None, timeout=600)
    return root, two, []


def test_deepspeed_zero_checkpoints_resume_in_our_engines(runs: tuple) -> None:
    _, two, _ = runs
    for rank, result in enumerate(two):
        for (stage, ours), got in ((k, v) for k, v in result.items() if isinstance(k, tuple)):
            where = f"DeepSpeed ZeRO-{stage} -> our stage {ours}, rank {rank}"
            assert got["loaded"] == "global_step2" and got["steps_loaded"] == 2, where
            assert got["steps"] == got["reference_steps"] == 4, where
            assert got["lr"] == pytest.approx(got["reference_lr"], rel=1e-12), where
            if rank == 0:
                assert got["diff"] < TOLERANCE, (where, got["diff"])
