"""Errors that name the problem when a load is given something else than one of our checkpoints (issue 49 item 4):

- a DCP folder with a damaged chunk: every rank raises naming the file ([Note: a foreign checkpoint fails on every
  rank] in accelerate_zero/checkpoint/foreign_load.py), instead of torch's "Weights only load failed" on one rank
  and a closed connection on the others;
- an accelerate FSDP save whose optimizer folder is missing: the missing folder is named (the weights still load
  with load_optimizer_states=False);
- a model export (config.json + weights) given to `engine.load_checkpoint`, `ZeroAccelerator.load_state` or the
  Trainer's resume: it says what the folder is and points to from_pretrained.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, train_steps


def _engine() -> Any:
    import accelerate_zero

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return accelerate_zero.initialize(model, optimizer, config={"zero_optimization": {"stage": 2}})


def _error(call: Any) -> str:
    try:
        call()
    except (ValueError, FileNotFoundError) as error:
        return str(error)
    return "loaded"


def _export(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")


def _body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    root_path = Path(root)
    engine = _engine()
    train_steps(engine, make_batches(1, 1, 6), rank, world_size, range(1))
    engine.save_checkpoint(root, tag="dcp", checkpoint_format="dcp")
    damaged, fsdp, export = root_path / "damaged", root_path / "fsdp_save", root_path / "export"
    if rank == 0:
        shutil.copytree(root_path / "dcp", damaged)
        victim = damaged / "__1_0.distcp"
        data = bytearray(victim.read_bytes())
        data[:8] = b"\0" * 8  # the first chunk's header
        victim.write_bytes(bytes(data))
        shutil.copytree(root_path / "dcp", fsdp / "pytorch_model_fsdp_0")  # accelerate's name, no optimizer_0/
        _export(export)
    torch.distributed.barrier()
    out = {"damaged": _error(lambda: _engine().load_checkpoint(str(damaged)))}
    out["no_optimizer"] = _error(lambda: _engine().load_checkpoint(str(fsdp)))
    out["weights_only"] = _error(lambda: _engine().load_checkpoint(str(fsdp), load_optimizer_states=False))
    out["export"] = _error(lambda: _engine().load_checkpoint(str(export)))
    return out


def _accelerator_body(rank: int, world_size: int, export: str) -> str:
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    accelerator = ZeroAccelerator(ZeroPlugin(config=config))
    model = make_model()
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    error = _error(lambda: accelerator.load_state(export))
    accelerator.free_memory()
    return error


@pytest.fixture(scope="module")
def errors(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], list[str]]:
    root = tmp_path_factory.mktemp("foreign_faults")
    results = run_distributed(_body, 2, str(root))
    return root, results, run_distributed(_accelerator_body, 2, str(root / "export"))


def test_a_damaged_dcp_chunk_is_named_on_every_rank(errors: tuple) -> None:
    root, results, _ = errors
    for result in results:
        assert str(root / "damaged" / "__1_0.distcp") in result["damaged"], result["damaged"]
        assert "damaged or truncated" in result["damaged"]


def test_a_missing_fsdp_optimizer_folder_is_named(errors: tuple) -> None:
    _, results, _ = errors
    for result in results:
        assert "optimizer state optimizer_0 is missing" in result["no_optimizer"], result["no_optimizer"]
        assert result["weights_only"] == "loaded"


def test_a_model_export_is_not_taken_for_a_training_checkpoint(errors: tuple) -> None:
    from accelerate_zero.integrations.transformers.trainer import _check_complete

    root, results, through_accelerator = errors
    with pytest.raises(ValueError) as trainer_error:
        _check_complete(str(root / "export"))
    for message in [r["export"] for r in results] + through_accelerator + [str(trainer_error.value)]:
        assert "is a model export (model.safetensors" in message and "from_pretrained(" in message, message
