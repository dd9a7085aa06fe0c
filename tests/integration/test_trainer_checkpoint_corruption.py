"""A damaged Trainer checkpoint folder (`checkpoint-N/`) is refused by `trainer.train(resume_from_checkpoint=...)`
with an error naming the damaged file.

Two ranks train the tiny Llama at stage 3 with the transformers Trainer and save `checkpoint-2`; the pytest process
damages copies of the output folder: a flipped byte in a rank file of the engine state (`zero_model/`), a rank file
a 3-rank job left there, a truncated `trainer_state.json`; and the Trainer's own files, which
`trainer_files.sha256.json` covers: a truncated or bit-flipped `scheduler.pt`, a truncated `rng_state_1.pth`, an
edited (still valid) `trainer_state.json`.
Three ranks then resume each copy, by path and with `resume_from_checkpoint=True`. The undamaged copy resumes and
trains on, so what refuses the others is the damage.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.checkpoints import DAMAGE, EXPECTED, truncate
from tests.helpers.dist import plain_torchrun_environment, run_distributed
from tests.integration import trainer_checks


SAVED_RANKS, ROWS_PER_STEP, STEPS = 2, 6, 3
CHECKPOINT = "checkpoint-2"


def _trainer(output_dir: str, world_size: int) -> Any:
    from accelerate_zero import Trainer, TrainingArguments

    kwargs = trainer_checks.args_kwargs(
        output_dir,
        ROWS_PER_STEP // world_size,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=2,
    )
    args = TrainingArguments(zero_config=trainer_checks.zero_config(3), **kwargs)
    return Trainer(model=trainer_checks.tiny_llama(), args=args, train_dataset=trainer_checks.dataset())


def _save(rank: int, world_size: int, root: str) -> None:
    plain_torchrun_environment()
    _trainer(f"{root}/saved", world_size).train()


def _resume(rank: int, world_size: int, root: str, cases: list[str]) -> dict[str, str]:
    """Each case's copy resumed from its checkpoint folder by path, and "latest damaged" with True."""
    plain_torchrun_environment()
    out = {}
    for case in cases:
        trainer = _trainer(f"{root}/{case}", world_size)
        resume: str | bool = True if case == "latest damaged" else f"{root}/{case}/{CHECKPOINT}"
        try:
            trainer.train(resume_from_checkpoint=resume)
        except Exception as error:  # the message is what the tests check
            out[case] = f"error {type(error).__name__}: {error}"
        else:
            out[case] = f"ok, global step {trainer.state.global_step}"
    return out


TRAINER_FILES = {"trainer_state.json truncated": "trainer_state.json"}
# [Note: the Trainer's files are checksummed too]: damage that their own readers would not name, or not see at all.
CHECKSUMMED = {
    "scheduler.pt truncated": "scheduler.pt",
    "scheduler.pt bit flipped": "scheduler.pt",
    "rng_state_1.pth truncated": "rng_state_1.pth",
    "trainer_state.json edited": "trainer_state.json",
}
ENGINE_DAMAGE = (
    "flipped byte",
    "3-rank leftover",
)  # a truncated rank file: tests/distributed/test_checkpoint_corruption.py
CASES = ["intact", *(f"zero_model {case}" for case in ENGINE_DAMAGE), "latest damaged", *TRAINER_FILES, *CHECKSUMMED]


def _flip_last_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-30] ^= 1  # inside the pickled values, before the zip directory: a load may well succeed
    path.write_bytes(bytes(data))


def _edit_global_step(path: Path) -> None:
    path.write_text(path.read_text().replace('"global_step": 2', '"global_step": 1'))  # still valid JSON


TRAINER_DAMAGE = {"truncated": truncate, "bit flipped": _flip_last_bit, "edited": _edit_global_step}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("trainer_corruption")
    run_distributed(_save, SAVED_RANKS, str(root))
    shutil.rmtree(root / "saved" / f"checkpoint-{STEPS}", ignore_errors=True)  # resume from checkpoint-2 only
    for case in CASES:
        shutil.copytree(root / "saved", root / case)
        checkpoint = root / case / CHECKPOINT
        if case.startswith("zero_model "):
            name, damage = DAMAGE[case.removeprefix("zero_model ")]
            damage(checkpoint / "zero_model" / name)
        elif case == "latest damaged":
            DAMAGE["flipped byte"][1](checkpoint / "zero_model" / "rank00001.safetensors")
        elif case in TRAINER_FILES or case in CHECKSUMMED:
            name = TRAINER_FILES.get(case) or CHECKSUMMED[case]
            TRAINER_DAMAGE[case.removeprefix(f"{name} ")](checkpoint / name)
    return root, run_distributed(_resume, 3, str(root), CASES)


def test_the_undamaged_checkpoint_resumes_on_3_ranks(resumed: Any) -> None:
    _, ranks = resumed
    assert [results["intact"] for results in ranks] == [f"ok, global step {STEPS}"] * 3


@pytest.mark.parametrize("case", ENGINE_DAMAGE)
def test_damaged_engine_state_is_refused_naming_the_file(resumed: Any, case: str) -> None:
    root, ranks = resumed
    folder = re.escape(str(root / f"zero_model {case}" / CHECKPOINT / "zero_model"))
    for rank, results in enumerate(ranks):
        message = results[f"zero_model {case}"]
        assert message.startswith("error ValueError"), (rank, message)
        assert re.search(EXPECTED[case].format(folder=folder), message), (rank, message)


def test_resume_from_the_latest_checkpoint_names_its_damaged_file(resumed: Any) -> None:
    root, ranks = resumed
    damaged = root / "latest damaged" / CHECKPOINT / "zero_model" / "rank00001.safetensors"
    for results in ranks:
        assert results["latest damaged"].startswith(f"error ValueError: {damaged} does not match its checksum")


def test_truncated_trainer_state_is_refused_naming_it(resumed: Any) -> None:
    root, ranks = resumed
    checkpoint = root / "trainer_state.json truncated" / CHECKPOINT
    for results in ranks:
        message = results["trainer_state.json truncated"]
        assert message.startswith(f"error ValueError: Can't resume from {checkpoint}: its save did not finish")
        assert "no readable trainer_state.json" in message


@pytest.mark.parametrize("case", CHECKSUMMED)
def test_damaged_trainer_files_are_refused_naming_them(resumed: Any, case: str) -> None:
    root, ranks = resumed
    damaged = root / case / CHECKPOINT / CHECKSUMMED[case]
    for results in ranks:  # every rank refuses, before anything is loaded
        assert results[case].startswith(f"error ValueError: {damaged} does not match the SHA-256"), results[case]
