"""What each rank runs for tests/integration/test_migration.py (one spawned group of 2 ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import plain_torchrun_environment
from tests.helpers.models import tiny_llama_config


PROBE = torch.arange(20).reshape(2, 10) % 61


def save_snippet(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """accelerate's documented stage-3 save, verbatim, on every rank; then every rank reaches a collective."""
    from transformers import LlamaForCausalLM

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    plain_torchrun_environment()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    accelerator = ZeroAccelerator(ZeroPlugin(config=config, zero3_save_16bit_model=True))
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=61, intermediate_size=45))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(input_ids=PROBE, labels=PROBE).loss)
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits

    out_dir = Path(folder) / "snippet"
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        out_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    state = accelerator.get_state_dict(model)
    accelerator.wait_for_everyone()  # a rank that raised or skipped the gather never gets here
    out: dict[str, Any] = {
        "keys": sorted(state),
        "devices": sorted({t.device.type for t in state.values()}),
        "shapes_match_main": None,
    }
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, shapes)
    out["shapes_match_main"] = all(g == gathered[0] for g in gathered)
    if rank == 0:
        out["files"] = sorted(p.name for p in out_dir.iterdir())
        with torch.no_grad():
            loaded = LlamaForCausalLM.from_pretrained(out_dir)(input_ids=PROBE).logits
        out["max_diff"] = (loaded.float() - logits.float()).abs().max().item()
    accelerator.wait_for_everyone()
    return out
