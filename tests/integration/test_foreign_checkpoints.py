"""Resuming, in our Trainer, the `checkpoint-N` folders transformers' own Trainer writes under DeepSpeed (a
`global_stepN/` and `latest` beside its files), with one changed line: `resume_from_checkpoint=` the folder. The
resumed run must end where the DeepSpeed run that never stopped ended (tests/integration/foreign_checks.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.dist import run_distributed
from tests.integration import foreign_checks


TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def deepspeed_trainer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("foreign_trainer")
    theirs = run_distributed(foreign_checks.deepspeed_trainer, 2, str(root / "deepspeed"), 3, timeout=600)
    checkpoint = str(root / "deepspeed" / f"checkpoint-{foreign_checks.SAVE_AT}")
    ours = run_distributed(foreign_checks.our_trainer_resumes, 2, checkpoint, 3, timeout=600)
    return {"theirs": theirs, "ours": ours}


def test_our_trainer_resumes_a_deepspeed_trainer_checkpoint(deepspeed_trainer: dict[str, Any]) -> None:
    theirs, ours = deepspeed_trainer["theirs"], deepspeed_trainer["ours"]
    assert "global_step2" in theirs[0]["files"] and "latest" in theirs[0]["files"], theirs[0]["files"]
    for rank in range(2):
        assert ours[rank]["step"] == theirs[rank]["step"] == 4
        # the steps after the resume: the same batches (loss) and learning rate
        for step in (3, 4):
            loss, lr = ours[rank]["log"][step]
            assert loss == pytest.approx(theirs[rank]["log"][step][0], rel=1e-5), (step, ours[rank]["log"])
            assert lr == pytest.approx(theirs[rank]["log"][step][1], rel=1e-12), (step, ours[rank]["log"])
    reference, got = theirs[0]["state"], ours[0]["state"]
    shared = [name for name in reference if name in got]
    assert len(shared) >= len(got) - 1  # lm_head.weight is tied to the embedding
    diff = max((got[name] - reference[name]).abs().max().item() for name in shared)
    assert diff < TOLERANCE, diff
