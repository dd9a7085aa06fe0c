"""Damaged stage-3 and NVMe-offload checkpoints are refused on another world size, naming the file, and the refusal
leaves the run that tried to load them as it was.

tests/distributed/test_checkpoint_faults.py damages stage-2 and stage-0 folders and loads them on one rank. Here two
ranks save a stage-3 run (sharded masters, and frozen shards saved as parameters) and a stage-3 run offloading
optimizer and parameters to NVMe; the pytest process damages copies of them (a flipped byte in a rank file's data,
a truncated rank file, the rank file of a 3-rank job left in the folder); three ranks then load every copy. Every
rank must raise a ValueError naming the damaged file (the same verdict everywhere, or the others would hang in the
load's collectives), before writing anything: the parameters, and under NVMe the masters and optimizer state in the
swap files, are unchanged.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checkpoints import DAMAGE, EXPECTED, saved_values
from tests.helpers.dist import run_distributed
from tests.helpers.models import gathered_flat, make_batches, make_model, train_steps


GLOBAL_BATCH, TAG = 6, "global_step2"
KINDS = ("stage3", "nvme")


def _zero(kind: str, swap: str) -> dict[str, Any]:
    # A persistence threshold of 10 elements shards every matrix: the rank files hold pieces of each parameter.
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 10, "sub_group_size": 50}
    if kind == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "buffer_count": 2}
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": 2}
    return zero


def _engine(kind: str, swap: str, seed: int) -> tuple[Any, torch.nn.Module]:
    import accelerate_zero

    model = make_model(seed=seed)
    model.norm.weight.requires_grad_(False)  # frozen shards, saved as parameters (not masters)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {"gradient_clipping": 1.0, "zero_optimization": _zero(kind, swap)}
    return accelerate_zero.initialize(model, optimizer, config=config), model


def _train(engine: Any, rank: int, world_size: int, steps: range) -> None:
    train_steps(engine, make_batches(4, 1, GLOBAL_BATCH), rank, world_size, steps)


def _save(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    out = {}
    for kind in KINDS:
        engine, model = _engine(kind, f"{root}/swap_saved", seed=0)
        _train(engine, rank, world_size, range(2))
        engine.save_checkpoint(f"{root}/{kind}")
        out[kind] = gathered_flat(model)
        engine.destroy()
    return out


def _outcome(action: Any, *args: Any) -> str:
    try:
        action(*args)
    except Exception as error:  # the message is what the tests check
        return f"error {type(error).__name__}: {error}"
    return "ok"


def _load(rank: int, world_size: int, root: str, cases: list[str]) -> dict[str, Any]:
    """Every damaged copy loaded into an engine that trained one step of its own (the NVMe one saves its state to
    `nvme_before` and `nvme_after` around the refused loads, to compare what its swap files hold), then the
    undamaged checkpoint into a fresh engine."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        engine, model = _engine(kind, f"{root}/swap_loading", seed=3)
        _train(engine, rank, world_size, range(1))
        if kind == "nvme":
            engine.save_checkpoint(f"{root}/nvme_before", tag="state")
        for case in cases:
            before = gathered_flat(model)
            outcome = _outcome(engine.load_checkpoint, f"{root}/{kind} {case}")
            out[f"{kind} {case}"] = outcome
            if outcome != "ok":
                out[f"{kind} {case} unchanged"] = torch.equal(gathered_flat(model), before)
        if kind == "nvme":
            engine.save_checkpoint(f"{root}/nvme_after", tag="state")
        engine.destroy()
        engine, model = _engine(kind, f"{root}/swap_intact", seed=3)
        engine.load_checkpoint(f"{root}/{kind}")
        out[f"{kind} intact"] = gathered_flat(model)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("corruption")
    saved = run_distributed(_save, 2, str(root))[0]
    for kind in KINDS:
        for case, (name, damage) in DAMAGE.items():
            shutil.copytree(root / kind, root / f"{kind} {case}")
            damage(root / f"{kind} {case}" / TAG / name)
    return root, saved, run_distributed(_load, 3, str(root), list(DAMAGE))


@pytest.mark.parametrize("case", list(DAMAGE))
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(loaded: Any, kind: str, case: str) -> None:
    root, _, ranks = loaded
    expected = EXPECTED[case].format(folder=re.escape(str(root / f"{kind} {case}" / TAG)))
    for rank, results in enumerate(ranks):
        message = results[f"{kind} {case}"]
        assert message.startswith("error ValueError"), (rank, message)
        assert re.search(expected, message), (rank, message)
        assert results[f"{kind} {case} unchanged"], rank  # refused before a value was written


def test_refused_loads_leave_the_nvme_swap_files_as_they_were(loaded: Any) -> None:
    root, _, _ = loaded
    before, after = saved_values(root / "nvme_before" / "state"), saved_values(root / "nvme_after" / "state")
    assert sorted(before) == sorted(after) and any(key.endswith("/exp_avg_sq") for key in before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize("kind", KINDS)
def test_the_undamaged_checkpoint_loads_on_3_ranks(loaded: Any, kind: str) -> None:
    _, saved, ranks = loaded
    for results in ranks:
        assert torch.equal(results[f"{kind} intact"], saved[kind])
