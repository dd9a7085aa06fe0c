"""[Note: each rank verifies what it reads] (checkpoint/meta.py): a loading rank hashes only the rank files it reads,
and a damaged file read by one rank is refused by every rank, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.checkpoints import flip_one_byte
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model


def _engine(stage: int) -> Any:
    import accelerate_zero

    model = make_model()
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)


def _save(rank: int, world_size: int, folder: str, stage: int) -> None:
    engine = _engine(stage)
    x, y = make_batches(1, 1, 2 * world_size).rank_slice(0, 0, rank, world_size)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(folder, tag="t")
    engine.destroy()


def _load(rank: int, world_size: int, folder: str, stage: int) -> dict[str, Any]:
    import accelerate_zero.checkpoint.meta as meta

    hashed: list[str] = []
    original = meta.file_digest

    def counting(path: Path) -> str:
        hashed.append(Path(path).name)
        return original(path)

    meta.file_digest = counting  # this rank process only, restored below
    engine = _engine(stage)
    try:
        engine.load_checkpoint(folder, tag="t")
        outcome = "loaded"
    except ValueError as error:
        outcome = str(error)
    finally:
        meta.file_digest = original
        engine.destroy()
    return {"hashed": sorted(hashed), "outcome": outcome}


def test_each_rank_hashes_only_the_files_it_reads_and_all_refuse_a_damaged_one(tmp_path: Path) -> None:
    for stage in (2, 3):
        folder = tmp_path / f"stage{stage}"
        run_distributed(_save, 3, str(folder), stage)
        loaded = run_distributed(_load, 3, str(folder), stage)
        # At the saved world size and stage each rank's ranges are its own file's: one file hashed per rank.
        assert [r["hashed"] for r in loaded] == [[f"rank{r:05d}.safetensors"] for r in range(3)], (stage, loaded)
        assert all(r["outcome"] == "loaded" for r in loaded), loaded
        flip_one_byte(folder / "t" / "rank00002.safetensors")  # only rank 2 reads it
        refused = run_distributed(_load, 3, str(folder), stage)
        for r in refused:
            assert r["outcome"].startswith(f"{folder}/t/rank00002.safetensors does not match its checksum"), r
        # Loaded on 2 ranks, the 3 saved files split between them: together they hash each file at least once.
        two = run_distributed(_load, 2, str(folder), stage)
        assert set().union(*(r["hashed"] for r in two)) == {f"rank{r:05d}.safetensors" for r in range(3)}, two
        assert all("rank00002.safetensors does not match" in r["outcome"] for r in two), two
