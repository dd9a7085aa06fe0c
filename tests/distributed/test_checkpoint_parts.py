"""[Note: a save streams its rank file in parts] (checkpoint/rank_parts.py): with a small part budget every rank writes
several parts, never holding more than the budget plus one fragment; the checkpoint is the same as one written in
one part per rank, and loads on another world size (also under NVMe optimizer offload)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from accelerate_zero.checkpoint.rank_parts import RankPartWriter
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model


BUDGET = 512  # bytes: the toy model's shard is a few KB per rank


def _engine(stage: int, nvme: str | None) -> Any:
    import accelerate_zero

    model = make_model()
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if nvme is not None:
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme}, sub_group_size=100)
    return accelerate_zero.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config={"zero_optimization": zero}
    )


def _save_both_ways(rank: int, world_size: int, folder: str, stage: int, nvme: bool) -> list[str]:
    import accelerate_zero.checkpoint.rank_parts as rank_parts

    engine = _engine(stage, f"{folder}/swap" if nvme else None)
    x, y = make_batches(1, 1, 2 * world_size).rank_slice(0, 0, rank, world_size)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(folder, tag="whole")
    default, rank_parts.SAVE_PART_BYTES = rank_parts.SAVE_PART_BYTES, BUDGET  # this rank process only
    try:
        engine.save_checkpoint(folder, tag="parts")
    finally:
        rank_parts.SAVE_PART_BYTES = default
    engine.destroy()
    return sorted(p.name for p in Path(folder, "parts").glob(f"rank{rank:05d}*.safetensors"))


def _load(rank: int, world_size: int, folder: str, stage: int) -> dict[str, torch.Tensor]:
    engine = _engine(stage, None)
    engine.load_checkpoint(folder, tag="parts")
    state = engine.full_state_dict()
    engine.destroy()
    return state


def test_a_save_in_parts_is_the_same_checkpoint_and_loads_elsewhere(tmp_path: Path) -> None:
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    for stage, nvme in ((2, False), (3, False), (3, True)):
        folder = tmp_path / f"stage{stage}{'-nvme' if nvme else ''}"
        files = run_distributed(_save_both_ways, 2, str(folder), stage, nvme)
        for rank, names in enumerate(files):
            assert len(names) > 2 and f"rank{rank:05d}.safetensors" in names, names  # several parts
        whole, parts = consolidated_state_dict(folder / "whole"), consolidated_state_dict(folder / "parts")
        assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)
        (loaded, *_) = run_distributed(_load, 3, str(folder), stage)
        assert all(torch.equal(loaded[k], parts[k].to(loaded[k].dtype)) for k in parts), stage


def test_the_writer_holds_at_most_its_budget_plus_one_fragment(tmp_path: Path) -> None:
    written: list[dict[str, torch.Tensor]] = []
    writer = RankPartWriter(
        tmp_path, 0, lambda tensors, path: written.append(dict(tensors)) or Path(path).touch(), 100
    )
    sizes = [7, 30, 1, 12, 40, 3]  # float32 elements: 28 to 160 bytes each
    for index, numel in enumerate(sizes):
        writer.add(f"t{index}", torch.full((numel,), float(index)))
    writer.flush()
    assert writer.peak_bytes <= 100 + 4 * max(sizes)
    assert [sorted(part) for part in written] == [["t0", "t1"], ["t2", "t3", "t4"], ["t5"]]  # a part ends at 100 bytes
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == [
        "rank00000-001.safetensors.sha256",
        "rank00000-002.safetensors.sha256",
        "rank00000.safetensors.sha256",
    ]
