"""`activation_checkpointing.cpu_checkpointing` at 3 ranks, one spawned group: training with it is bit-identical to
training without it (stages 0-3, fp32 and bf16, the model's gradient checkpointing off, non-reentrant and
reentrant, 2 micro-steps per step), and the bytes it holds in host memory after a forward are what autograd saved
there, parameters left out ([Note: activations in host memory] in engine/activation_offload.py)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


STEPS, GRAD_ACCUM, PER_RANK_BATCH, SEQ, VOCAB = 2, 2, 2, 12, 64
CASES = [
    (stage, bf16, checkpointing)
    for stage in (0, 1, 2, 3)
    for bf16 in (False, True)
    for checkpointing in (None, "non-reentrant", "reentrant" if stage in (0, 3) else None)
]
CASES = list(dict.fromkeys(CASES))


def activation_hooks(engine: Any) -> Any:
    """The engine's `ActivationsToHost` (engine/assemble.py's `EngineParts.activation_offload`)."""

    return engine.activation_offload


class _SavedBytes:
    """Counts the bytes of what autograd saves under it, apart from the model's parameters (by storage)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.activations, self.tensors = model, 0, 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensors += 1
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters() if p.untyped_storage().nbytes()}
        if tensor.untyped_storage().data_ptr() not in params:
            self.activations += tensor.numel() * tensor.element_size()
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def _train(base: nn.Module, rank: int, stage: int, bf16: bool, checkpointing: str | None, cpu: bool) -> dict:
    import accelerate_zero

    model = copy.deepcopy(base)
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "activation_checkpointing": {"cpu_checkpointing": cpu},
    }
    engine = accelerate_zero.initialize(model, config=config, device="cpu")
    hooks = activation_hooks(engine)
    torch.manual_seed(10 + rank)
    tokens = torch.randint(0, VOCAB, (STEPS * GRAD_ACCUM, PER_RANK_BATCH, SEQ))
    out: dict[str, Any] = {"losses": [], "forward": [], "outer": []}
    for micro, batch in enumerate(tokens):
        saved = _SavedBytes(engine.module)
        with saved.hooks():
            # every other micro-step calls the model directly, as a ZeroAccelerator-prepared model or the Trainer do
            call = engine if micro % 2 == 0 else engine.module
            loss = call(input_ids=batch, labels=batch).loss
        out["outer"].append((saved.tensors, saved.activations))
        if hooks is not None:
            reported = engine.memory_breakdown()["host_activations"]
            out["forward"].append((hooks.stats.packed_bytes, hooks.stats.held_bytes, hooks.stats.kept_bytes, reported))
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.detach().float().item())
        if hooks is not None:
            out.setdefault("after_backward", []).append((hooks.stats.held_bytes, hooks.stats.unpacked_bytes))
    if hooks is not None:
        before = dataclasses.astuple(hooks.stats)
        with torch.no_grad():
            engine.module(input_ids=tokens[0])
        out["no_grad"] = (before, dataclasses.astuple(hooks.stats))
    with accelerate_zero.GatheredParameters(list(engine.module.parameters())):
        out["weights"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    out["hooks"] = hooks is not None
    engine.destroy()
    return out


def _cpu_checkpointing(rank: int, world_size: int) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())
    results = {}
    for stage, bf16, checkpointing in CASES:
        results[stage, bf16, checkpointing] = {
            cpu: _train(base, rank, stage, bf16, checkpointing, cpu) for cpu in (False, True)
        }
    return results


def test_cpu_checkpointing_is_bit_identical_and_holds_what_autograd_saved() -> None:
    for rank, results in enumerate(run_distributed(_cpu_checkpointing, 3)):
        for case, runs in results.items():
            plain, offloaded = runs[False], runs[True]
            where = (rank, case)
            assert not plain["hooks"] and offloaded["hooks"], where
            assert offloaded["losses"] == plain["losses"], where
            for name, weight in plain["weights"].items():
                torch.testing.assert_close(offloaded["weights"][name], weight, rtol=0, atol=0, msg=f"{where} {name}")
            for micro, (packed, held, kept, reported) in enumerate(offloaded["forward"]):
                # What the plain run's autograd saved outside the parameters is what went to host memory, and all
                # of it is held there until backward; the parameters' saved views stayed where they were.
                tensors, activations = plain["outer"][micro]
                assert packed == activations > 0, (where, micro, packed, activations)
                assert held == packed == reported, (where, micro, reported)  # memory_breakdown's host_activations
                # The hooks sit inside any the caller opens: the caller's see nothing, whatever the entry point.
                assert offloaded["outer"][micro] == (0, 0), (where, micro)
                assert kept > 0 or case[2] is not None, (where, micro)  # without checkpointing weights are saved
            for held, unpacked in offloaded["after_backward"]:
                assert held == 0 and unpacked > 0, where
            before, after = offloaded["no_grad"]
            assert before == after and after[3] == 0, where  # a forward without grad changes nothing
