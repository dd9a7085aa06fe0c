"""The Trainer's asynchronous checkpoint saves and its resume from a DCP folder ([Note: the Trainer's asynchronous
saves] in accelerate_zero/integrations/transformers/checkpoint_saves.py).

Two ranks train the tiny Llama at stage 3 with AdamW, saving every step with `save_total_limit=1` and the best model
kept (`load_best_model_at_end`): once with synchronous saves, once with `checkpoint.writer.decoupled: true`. In the
asynchronous run the writer of every save after the first is held until the Trainer's `on_save` has looked at the
output folder: the previous checkpoint (the last one published) must still be there and complete, the new one
incomplete; the rotation runs once the writer published. Both runs end with the same weights, losses and checkpoint folders, and
the engine files of the checkpoint they keep are byte for byte the same (the SHA-256s in meta.json).

Resume from DCP: run a saves `checkpoint-2` and, at step 2, a DCP checkpoint of the engine (the layout FSDP2 writes;
tests/distributed/test_checkpoint_dcp.py loads it into FSDP2 and FSDP2's into ours). Run b resumes `checkpoint-2`
with `ignore_data_skip=True`, run c the DCP folder: c continues from step 2 with the same learning rates, losses and
final weights as b. Its `save_model` at stage 3 (files of 20 kB) has every rank write its files, and
`from_pretrained` loads the trained weights.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import plain_torchrun_environment, run_distributed
from tests.integration import trainer_checks


WORLD, MICRO = 2, 3
RELEASE_SECONDS = 60.0


def _trainer(output_dir: Path, asynchronous: bool, callbacks: list, **overrides: Any) -> Any:
    from accelerate_zero import Trainer, TrainingArguments

    config = trainer_checks.zero_config(3)
    if asynchronous:
        config["checkpoint"] = {"writer": {"decoupled": True}}
    kwargs = trainer_checks.args_kwargs(output_dir, MICRO, optim="adamw_torch", learning_rate=1e-2, **overrides)
    args = TrainingArguments(zero_config=config, **kwargs)
    model = trainer_checks.tiny_llama()
    return Trainer(
        model=model,
        args=args,
        train_dataset=trainer_checks.dataset(),
        eval_dataset=trainer_checks.dataset(8),
        callbacks=callbacks,
    )


def _complete(folder: Path) -> bool:
    from accelerate_zero.integrations.transformers.trainer import _is_complete

    return _is_complete(folder)


def _listing(output_dir: Path) -> dict[str, bool]:
    return {p.name: _complete(p) for p in sorted(output_dir.glob("checkpoint-*"))}


def _saving_run(root: Path, asynchronous: bool) -> dict[str, Any]:
    from transformers import TrainerCallback

    from accelerate_zero.checkpoint import engine_io

    releases = {f"checkpoint-{step}": threading.Event() for step in range(2, trainer_checks.STEPS + 1)}
    seen: dict[str, Any] = {"during": {}, "released_in_time": []}
    real = engine_io.save_file

    def held(tensors: dict[str, torch.Tensor], path: str) -> None:
        folder = re.search(r"checkpoint-\d+", path)
        if folder is not None and folder.group() in releases:  # every save after the first waits for on_save
            seen["released_in_time"].append(releases[folder.group()].wait(RELEASE_SECONDS))
        real(tensors, path)

    class Look(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            name = f"checkpoint-{state.global_step}"
            if name in releases:
                seen["during"][name] = _listing(output_dir)
                releases[name].set()

    output_dir = root / ("async" if asynchronous else "sync")
    trainer = _trainer(
        output_dir,
        asynchronous,
        [Look()],
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )
    engine_io.save_file = held if asynchronous else real
    try:
        trainer.train()
    finally:
        engine_io.save_file = real
    trainer.accelerator.wait_for_everyone()  # rank 0 removes checkpoints at the end of train()
    kept = max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return {
        **seen,
        "after": _listing(output_dir),
        "best": Path(trainer.state.best_model_checkpoint).name,
        "state": trainer.accelerator.get_state_dict(trainer.model),
        "losses": trainer_checks.losses(trainer),
        "digests": json.loads((kept / "zero_model" / "meta.json").read_text())["files"],
        "saved_limit": torch.load(kept / "training_args.bin", weights_only=False).save_total_limit,
    }


def _dcp_resume(root: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    class SaveDcp(TrainerCallback):
        trainer: Any = None
        folder: Path | None = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:  # the folder holds .metadata and the ranks' .distcp files, as FSDP2's
                self.folder = Path(
                    self.trainer.zero_engine.save_checkpoint(str(root / "dcp"), checkpoint_format="dcp")
                )

    save_dcp = SaveDcp()
    a = _trainer(root / "a", False, [save_dcp], save_strategy="steps", save_steps=2)
    save_dcp.trainer = a
    a.train()
    out = {"dcp_files": sorted(p.name for p in save_dcp.folder.iterdir()), "export": _export(a, root / "export")}
    for name, folder in (("b", root / "a" / "checkpoint-2"), ("c", save_dcp.folder)):
        trainer = _trainer(root / name, False, [], ignore_data_skip=True)
        trainer.train(resume_from_checkpoint=str(folder))
        out[name] = {
            "state": trainer.accelerator.get_state_dict(trainer.model),
            "losses": trainer_checks.losses(trainer),
            "lrs": [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry],
            "global_step": trainer.state.global_step,
        }
    return out


def _export(trainer: Any, folder: Path) -> dict[str, Any]:
    """save_model at stage 3 with files of 20 kB: each rank writes its files ([Note: parallel Hugging Face
    export]); from_pretrained (rank 0) must give the trained weights."""
    from transformers import LlamaForCausalLM

    from accelerate_zero.checkpoint import hf_export
    from accelerate_zero.integrations.transformers import checkpoint_saves

    real_save, real_bytes, written = hf_export.save_file, checkpoint_saves.SAVE_PRETRAINED_SHARD_BYTES, []

    def recording(tensors: dict[str, torch.Tensor], path: str, **kwargs: Any) -> None:
        written.append(Path(path).name)
        real_save(tensors, path, **kwargs)

    hf_export.save_file, checkpoint_saves.SAVE_PRETRAINED_SHARD_BYTES = recording, 20_000
    try:
        trainer.save_model(str(folder))
    finally:
        hf_export.save_file, checkpoint_saves.SAVE_PRETRAINED_SHARD_BYTES = real_save, real_bytes
    state = trainer.accelerator.get_state_dict(trainer.model)
    out: dict[str, Any] = {"written": written}
    if trainer.accelerator.is_main_process:  # the other ranks get meta tensors
        loaded = LlamaForCausalLM.from_pretrained(folder).state_dict()
        out["same"] = all(torch.equal(loaded[name], value) for name, value in state.items() if name in loaded)
        out["files"] = sorted(p.name for p in folder.glob("*.safetensors*"))
    return out


def _accelerator_export(folder: Path) -> dict[str, Any]:
    """`ZeroAccelerator.save_model` at stage 3 with files of 20 kB: each rank writes its files too, and
    from_pretrained (rank 0) gives the trained weights."""
    from safetensors.torch import load_file

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.checkpoint import hf_export
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    accelerator = ZeroAccelerator(ZeroPlugin(config=config))
    model = trainer_checks.tiny_llama()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rows = trainer_checks.PROBE
    accelerator.backward(model(input_ids=rows, labels=rows).loss)
    optimizer.step()
    real_save, written = hf_export.save_file, []

    def recording(tensors: dict[str, torch.Tensor], path: str, **kwargs: Any) -> None:
        written.append(Path(path).name)
        real_save(tensors, path, **kwargs)

    hf_export.save_file = recording
    try:
        accelerator.save_model(model, str(folder), max_shard_size=20_000)
    finally:
        hf_export.save_file = real_save
    state = accelerator.get_state_dict(model)
    out: dict[str, Any] = {"written": written}
    if accelerator.is_main_process:
        # The files the index names, read as from_pretrained reads them (from_pretrained itself would gather under
        # this process's ZeRO-3 context, with rank 1 gone).
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        loaded = {}
        for name in sorted(set(index.values())):
            loaded.update(load_file(folder / name))
        tied = set(state) - set(loaded)  # save_pretrained leaves out a tied head, as from_pretrained ties it back
        out["same"] = tied <= {"lm_head.weight"} and all(torch.equal(v, state[n]) for n, v in loaded.items())
        out["files"] = sorted(p.name for p in folder.glob("*.safetensors*"))
    return out


def _body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    plain_torchrun_environment()
    folder = Path(root)
    return {
        "sync": _saving_run(folder, asynchronous=False),
        "async": _saving_run(folder, asynchronous=True),
        "dcp": _dcp_resume(folder),
        "accelerator_export": _accelerator_export(folder / "accelerator_export"),
    }


@pytest.fixture(scope="module")
def all_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_body, WORLD, str(tmp_path_factory.mktemp("trainer_async")), timeout=600)


@pytest.fixture(scope="module")
def ranks(all_ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return all_ranks[0]


def test_save_model_at_stage_3_writes_from_every_rank(all_ranks: list[dict[str, Any]]) -> None:
    first, second = (result["dcp"]["export"] for result in all_ranks)
    assert first["written"] and second["written"], (first["written"], second["written"])  # both ranks wrote files
    assert set(first["written"]).isdisjoint(second["written"])
    assert len(first["files"]) == len(first["written"]) + len(second["written"]) + 1  # and the index
    assert "model.safetensors.index.json" in first["files"] and first["same"]


def test_rotation_waits_for_the_writer_to_publish(ranks: dict[str, Any]) -> None:
    run = ranks["async"]
    assert run["released_in_time"] and all(run["released_in_time"])
    assert sorted(run["during"]) == [f"checkpoint-{step}" for step in range(2, trainer_checks.STEPS + 1)]
    for name, listing in run["during"].items():
        step = int(name.split("-")[1])
        # while checkpoint-N is written, checkpoint-(N-1), the last one published, is still there (whichever one
        # is the best model, which rotation keeps anyway)
        assert listing[f"checkpoint-{step - 1}"] is True, (name, listing)
        assert listing[name] is False, (name, listing)
        assert sum(listing.values()) <= 2, (name, listing)  # the older ones were rotated once published


def test_asynchronous_run_equals_the_synchronous_one(ranks: dict[str, Any]) -> None:
    sync, run = ranks["sync"], ranks["async"]
    assert run["after"] == sync["after"] and all(run["after"].values())
    assert run["best"] == sync["best"]
    assert run["saved_limit"] == sync["saved_limit"] == 1  # the arguments saved are the run's own
    assert run["losses"] == sync["losses"]
    assert run["digests"] == sync["digests"]
    assert sync["state"].keys() == run["state"].keys()
    for name, value in sync["state"].items():
        assert torch.equal(value, run["state"][name]), name


def test_resume_from_a_dcp_folder_continues_exactly(ranks: dict[str, Any]) -> None:
    out = ranks["dcp"]
    assert ".metadata" in out["dcp_files"]
    b, c = out["b"], out["c"]
    assert c["global_step"] == b["global_step"] == trainer_checks.STEPS
    # b's history holds a's first two steps too (its trainer_state.json); c's starts at step 3
    assert len(c["losses"]) == trainer_checks.STEPS - 2
    assert c["lrs"] == b["lrs"][2:]
    assert c["losses"] == b["losses"][2:]
    for name, value in b["state"].items():
        assert torch.equal(value, c["state"][name]), name


def test_zero_accelerator_save_model_at_stage_3_writes_from_every_rank(all_ranks: list[dict[str, Any]]) -> None:
    first, second = (result["accelerator_export"] for result in all_ranks)
    assert first["written"] and second["written"], (first["written"], second["written"])
    assert set(first["written"]).isdisjoint(second["written"])
    assert len(first["files"]) == len(first["written"]) + len(second["written"]) + 1  # and the index
    assert first["same"]
