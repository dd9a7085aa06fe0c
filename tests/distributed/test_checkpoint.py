"""Engine checkpoints: exact resume, resume on another world size and stage, and interrupted saves.

Phase 1 (2 ranks, stage 2) trains 3 steps, saves, trains 3 more: the uninterrupted run. Then a fresh engine
loads the checkpoint and trains the same 3 steps: at 2 ranks and stage 2 the result is bit-identical; at 3 ranks
and stage 3, and at 1 rank and stage 0, it matches to float rounding. A leftover partial folder from a killed
save never replaces the last good checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import gathered_flat, make_batches, make_model, train_steps


STEPS, GLOBAL_BATCH = 6, 6


def _engine(stage: int) -> tuple[Any, torch.nn.Module]:
    import accelerate_zero

    model = make_model(seed=5)  # a different init than the loaded weights: loading must overwrite it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    zero = {"stage": stage, "reduce_bucket_size": 60, "stage3_param_persistence_threshold": 20}
    config = {"gradient_clipping": 1.0, "zero_optimization": zero}
    return accelerate_zero.initialize(model, optimizer, config=config, lr_scheduler=scheduler), model


def _steps(engine: Any, rank: int, world_size: int, steps: range) -> None:
    train_steps(engine, make_batches(STEPS, 1, GLOBAL_BATCH), rank, world_size, steps)


def _original(rank: int, world_size: int, folder: str) -> dict[str, Any]:

    torch.manual_seed(0)
    engine, model = _engine(stage=2)
    _steps(engine, rank, world_size, range(3))
    path = engine.save_checkpoint(folder, client_state={"epoch": 7})
    _steps(engine, rank, world_size, range(3, STEPS))
    return {"params": gathered_flat(model), "path": path, "lr": engine.get_lr()}


def _resumed(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    engine, model = _engine(stage)
    _, client_state = engine.load_checkpoint(folder)
    steps_loaded = engine.global_steps
    _steps(engine, rank, world_size, range(3, STEPS))
    return {"params": gathered_flat(model), "client": client_state, "steps": steps_loaded, "lr": engine.get_lr()}


def test_resume_exact_and_across_world_sizes_and_stages(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    original = run_distributed(_original, 2, folder)[0]
    assert Path(original["path"]).name == "global_step3"
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    # A save killed half-way leaves a partial folder behind: it must not be what gets loaded.
    (tmp_path / "ckpt" / ".global_step9.partial").mkdir()
    same = run_distributed(_resumed, 2, folder, 2)[0]
    assert same["client"] == {"epoch": 7} and same["steps"] == 3
    assert torch.equal(same["params"], original["params"])  # bit-identical continuation
    assert same["lr"] == original["lr"]
    for world_size, stage in ((3, 3), (1, 0)):
        other = run_distributed(_resumed, world_size, folder, stage)[0]
        assert (other["params"] - original["params"]).abs().max().item() < 1e-6, (world_size, stage)
        assert other["lr"] == original["lr"]
