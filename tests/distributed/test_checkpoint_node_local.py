"""A checkpoint folder on a node-local disk ([Note: a checkpoint folder only some ranks see] in checkpoint/io.py):
every rank raises naming the ranks and nodes that cannot see it, nothing is published, nobody waits for the
timeout. Two simulated nodes of one rank; rank 1's "same path" is another folder, as on its own disk, with a stale
partial folder of an earlier save in it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_model


def _save_where_only_rank_0_sees(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import accelerate_zero

    os.environ["ACCELERATE_ZERO_SIMULATED_NODES"] = "2"
    model = make_model()
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": {"stage": 3}}
    )
    disk = Path(folder) / f"node{rank}"
    stale = disk / ".t.partial"
    stale.mkdir(parents=True, exist_ok=True)
    (stale / ".shared_by_every_rank").write_text("an earlier save's token")
    try:
        engine.save_checkpoint(str(disk), tag="t")
        error = None
    except OSError as caught:
        error = str(caught)
    engine.save_checkpoint(f"{folder}/shared", tag="t")  # a shared folder still saves
    return {"error": error, "published": (Path(folder) / "node0" / "t").exists()}


def test_a_node_local_checkpoint_folder_is_named_on_every_rank(tmp_path) -> None:
    results = run_distributed(_save_where_only_rank_0_sees, 2, str(tmp_path))
    for result in results:
        assert result["error"] is not None and "ranks [1] (node(s) [1])" in result["error"], result
        assert "node-local disk" in result["error"]
        assert not result["published"]
    assert (tmp_path / "shared" / "t").is_dir()
