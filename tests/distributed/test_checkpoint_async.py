"""Asynchronous engine checkpoints ([Note: asynchronous saves] in accelerate_zero/checkpoint/async_save.py).

One 2-rank body, at stages 0, 2 and 3: a save with `async_save=True` returns while its writer is held, training
goes on for a step during the write (the writer is released by that step), `latest` names the previous checkpoint
until the writer publishes, and the files published are byte for byte those of a synchronous save taken at the same
step (the same SHA-256s in meta.json). A second save waits for the first; a load (by another engine) waits for the
save in flight and restores it exactly; a writer that fails on one rank makes the next save raise on every rank, naming the rank,
with `latest` unchanged. The writer copies the snapshot itself, and the next optimizer step waits for that copy:
held for a second, the step waits and the checkpoint holds the values of its own step. A job killed while the writer runs is tests/integration/test_killed_save.py's "async" case.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import gathered_flat, make_batches, make_model, train_steps


STEPS, GLOBAL_BATCH = 5, 6
RELEASE_SECONDS = 60.0
HELD_COPY_SECONDS = 1.0


def _engine(stage: int, seed: int = 0) -> tuple[Any, torch.nn.Module]:
    import accelerate_zero

    model = make_model(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    zero = {"stage": stage, "reduce_bucket_size": 60}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 20
    config = {"zero_optimization": zero}
    return accelerate_zero.initialize(model, optimizer, config=config, lr_scheduler=scheduler), model


def _steps(engine: Any, rank: int, world_size: int, steps: range) -> None:
    train_steps(engine, make_batches(STEPS, 1, GLOBAL_BATCH), rank, world_size, steps)


def _files(folder: Path) -> dict[str, str]:
    return json.loads((folder / "meta.json").read_text())["files"]


class _HeldWriter:
    """Wraps engine_io.save_file: the writer thread waits until `release` (set by the training thread)."""

    def __init__(self, real: Any, fail: bool = False) -> None:
        self.real, self.fail = real, fail
        self.release = threading.Event()
        self.released_in_time: bool | None = None

    def __call__(self, tensors: dict[str, torch.Tensor], path: str) -> None:
        self.released_in_time = self.release.wait(RELEASE_SECONDS)
        if self.fail:
            raise OSError(f"disk full while writing {Path(path).name}")
        self.real(tensors, path)


def _one_stage(rank: int, world_size: int, root: Path, stage: int) -> dict[str, Any]:
    from accelerate_zero.checkpoint import engine_io

    out: dict[str, Any] = {}
    engine, model = _engine(stage)
    _steps(engine, rank, world_size, range(2))
    engine.save_checkpoint(str(root / "sync"))  # global_step2, the reference
    engine.save_checkpoint(str(root / "async"), tag="first")
    held = _HeldWriter(engine_io.save_file)
    engine_io.save_file = held
    try:
        folder = Path(engine.save_checkpoint(str(root / "async"), async_save=True))
        out["returned_before_written"] = not (root / "async" / "global_step2").exists()
        out["latest_during_write"] = (root / "async" / "latest").read_text()
        _steps(engine, rank, world_size, range(2, 3))  # training goes on while the writer is held
        out["params_step3"] = gathered_flat(model)
        held.release.set()
        held_second = _HeldWriter(held.real)  # the first writer is past its only call of save_file
        engine_io.save_file = held_second
        # A second save waits for the first: once it returns, global_step2 is published.
        engine.save_checkpoint(str(root / "async"), tag="second", async_save=True)
        out["first_published_when_second_returned"] = (folder / "meta.json").is_file()
        out["writer_released_by_training"] = held.released_in_time
        out["same_files_as_sync"] = _files(folder) == _files(root / "sync" / "global_step2")
        _steps(engine, rank, world_size, range(3, STEPS))
        out["params_end"] = gathered_flat(model)
        # Another engine's load waits for the save in flight ("second", at step 3) and restores it exactly.
        threading.Timer(1.0, held_second.release.set).start()
        fresh, fresh_model = _engine(stage, seed=5)
        fresh.load_checkpoint(str(root / "async"))
    finally:
        engine_io.save_file = held.real
        held.release.set()
    out["loaded_steps"] = fresh.global_steps
    out["loaded_params"] = gathered_flat(fresh_model)
    _steps(fresh, rank, world_size, range(3, STEPS))
    out["resumed_params_end"] = gathered_flat(fresh_model)
    out["latest_after"] = (root / "async" / "latest").read_text()
    return out


def _failing_writer(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    from accelerate_zero.checkpoint import engine_io

    engine, _ = _engine(stage=2)
    _steps(engine, rank, world_size, range(1))
    engine.save_checkpoint(str(root / "failing"))
    held = _HeldWriter(engine_io.save_file, fail=rank == 1)
    held.release.set()
    engine_io.save_file = held
    try:  # the failing writer stays in place until the next save has waited for the writer that uses it
        engine.save_checkpoint(str(root / "failing"), tag="broken", async_save=True)
        try:
            engine.save_checkpoint(str(root / "failing"), tag="next")
        except OSError as error:
            raised = str(error)
        else:
            raised = None
    finally:
        engine_io.save_file = held.real
    return {
        "raised": raised,
        "latest": (root / "failing" / "latest").read_text(),
        "broken_published": (root / "failing" / "broken").exists(),
    }


def _copy_held_past_a_step(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """[Note: the snapshot is copied by the writer]: the writer's copy is held for a while; the next step's
    optimizer step must wait for it, so the checkpoint still holds the values of the step it was taken at."""
    from accelerate_zero.checkpoint import async_save

    engine, _ = _engine(stage=2)
    _steps(engine, rank, world_size, range(2))
    engine.save_checkpoint(str(root / "fence"), tag="sync")
    real_copy, release = async_save._Snapshot.copy, threading.Event()

    def held_copy(snapshot: Any) -> None:
        release.wait(RELEASE_SECONDS)
        real_copy(snapshot)

    async_save._Snapshot.copy = held_copy
    try:
        engine.save_checkpoint(str(root / "fence"), tag="async", async_save=True)
        threading.Timer(HELD_COPY_SECONDS, release.set).start()
        start = time.perf_counter()
        _steps(engine, rank, world_size, range(2, 3))
        step_seconds = time.perf_counter() - start
    finally:
        async_save._Snapshot.copy = real_copy
    async_save.finish(engine.layout.world)
    return {
        "step_waited": step_seconds >= 0.8 * HELD_COPY_SECONDS,
        "same_files": _files(root / "fence" / "sync") == _files(root / "fence" / "async"),
    }


def _body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out = {stage: _one_stage(rank, world_size, Path(root) / f"stage{stage}", stage) for stage in (0, 2, 3)}
    out["failing"] = _failing_writer(rank, world_size, Path(root))
    return out


def test_async_saves(tmp_path: Path) -> None:
    results = run_distributed(_body, 2, str(tmp_path))
    for stage in (0, 2, 3):
        for rank, result in enumerate(results):
            got = result[stage]
            where = f"stage {stage} rank {rank}"
            assert got["returned_before_written"], where
            assert got["latest_during_write"] == "first", where
            assert got["writer_released_by_training"] is True or (stage == 0 and rank == 1), where
            assert got["first_published_when_second_returned"], where
            assert got["same_files_as_sync"], where
            assert got["loaded_steps"] == 3, where
            assert torch.equal(got["loaded_params"], got["params_step3"]), where
            assert torch.equal(got["resumed_params_end"], got["params_end"]), where
            assert got["latest_after"] == "second", where
    for rank, result in enumerate(results):
        failing = result["failing"]
        assert failing["raised"] is not None and "rank 1" in failing["raised"], (rank, failing)
        assert "disk full while writing rank00001.safetensors" in failing["raised"], failing
        assert failing["latest"] == "global_step1" and not failing["broken_published"], failing


def _fence_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _copy_held_past_a_step(rank, world_size, Path(root))


def test_the_next_step_waits_for_the_snapshot(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_fence_body, 2, str(tmp_path))):
        assert result == {"step_waited": True, "same_files": True}, (rank, result)
