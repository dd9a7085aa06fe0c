"""peft LoRA on split experts (issue 52; [Note: LoRA on split experts] in engine/experts/adapters.py).

A tiny Qwen2-MoE (4 experts, top-2, a shared expert and its gate) carries LoRA on the fused experts
(`target_parameters` on `mlp.experts.gate_up_proj` and `down_proj`), on the router (`mlp.gate.weight`), on the
shared expert (`shared_expert.up_proj`) and on attention (`q_proj`); the base is frozen. One group of 4 ranks trains
it for 2 steps of AdamW with accumulation 2 and active clipping at ep 2 and 4, stages 1, 2 and 3, against one process
on the whole batch: every step's loss, the clipped norm and every adapter tensor (fp32, within 1e-5); the base stays
as it was. At ep 2, stage 3 the adapter `save_pretrained` writes (from the engine's whole state dict) loads into an
unsplit model that computes the trained model's logits, and the weight stream (`named_full_parameters`) hands over
the whole experts with their adapters merged, equal to peft's `merge_and_unload` of the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_expert_parallel_engine import ACCUM, EPS, LR, WORLD_SIZE, _batches


MAX_NORM = 0.005  # the adapters' gradient norm is ~0.008: clipping acts on every step


CASES = [(ep, stage) for ep in (2, 4) for stage in (1, 2, 3)]
TARGETS = {
    "target_modules": ["q_proj", "shared_expert.up_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
}


def _base() -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, intermediate_size=40, moe_intermediate_size=24,
        shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return model.float()


def _adapted() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_base(), LoraConfig(r=2, lora_alpha=4, **TARGETS))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make every adapter matter from the first forward
            torch.nn.init.normal_(param, std=0.1)
    return model


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _reference() -> dict[str, Any]:
    model = _adapted()
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.01, eps=EPS)
    losses, norms = [], []
    for step in _batches():
        total = 0.0
        for micro in step:
            tokens = micro.reshape(-1, micro.shape[-1])
            loss = model(input_ids=tokens, labels=tokens).loss / ACCUM
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(_trainable(model), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    probe = _batches()[0, 0].reshape(-1, _batches().shape[-1])
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {n: p.detach().clone() for n, p in model.merge_and_unload().named_parameters()}
    return {"losses": losses, "norms": norms, "params": state, "logits": logits, "merged": merged}


def _engine_run(ep: int, stage: int, rank: int, folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    import accelerate_zero

    model = _adapted()
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.01, eps=EPS)
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 3000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": MAX_NORM,
        "zero_optimization": zero,
        "expert_parallel": {"enabled": True, "autoep_size": ep},
    }
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    losses, norms = [], []
    for step in _batches():
        total = torch.zeros(())
        for micro in step:
            loss = engine(input_ids=micro[rank], labels=micro[rank]).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / ACCUM
        dist.all_reduce(total)
        losses.append(total.item() / WORLD_SIZE)
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
    if (ep, stage) == (2, 3):
        out["stream"] = {n: t.clone() for n, t in engine.named_full_parameters(max_bytes=1)}
        if rank == 0:
            model.save_pretrained(folder, state_dict=out["params"])
    engine.destroy()
    return out


def _unsplit_logits(folder: str) -> torch.Tensor:
    """The saved adapter, loaded by peft into a fresh unsplit base."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_base(), folder)
    probe = _batches()[0, 0].reshape(-1, _batches().shape[-1])
    with torch.no_grad():
        return loaded(input_ids=probe).logits


def _all(rank: int, world_size: int, folder: str) -> dict[Any, Any]:
    reference = _reference()
    out: dict[Any, Any] = {}
    for ep, stage in CASES:
        got = _engine_run(ep, stage, rank, folder)
        errors = {n: (v.float() - reference["params"][n]).abs().max().item() for n, v in got["params"].items()}
        out[(ep, stage)] = {
            "loss": max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)),
            "norm": max(abs(a - b) for a, b in zip(got["norms"], reference["norms"], strict=True)),
            "clipped": min(reference["norms"]) > MAX_NORM,
            "errors": errors,
            "adapters_moved": max(
                (reference["params"][n] - p).abs().max().item()
                for n, p in _adapted().named_parameters()
                if "lora_" in n
            ),  # fmt: skip
        }
        if "stream" in got:
            stream = got["stream"]
            out["stream_names"] = sorted(stream) == sorted(reference["merged"])
            out["stream"] = max((stream[n] - v).abs().max().item() for n, v in reference["merged"].items())
    torch.distributed.barrier()  # rank 0 has written the adapter
    out["reloaded"] = (_unsplit_logits(folder) - reference["logits"]).abs().max().item()
    return out


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all, WORLD_SIZE, str(tmp_path_factory.mktemp("ep_lora")), timeout=600)


@pytest.mark.parametrize(("ep", "stage"), CASES)
def test_lora_on_split_experts_equals_one_process(by_rank: list[dict[Any, Any]], ep: int, stage: int) -> None:
    main = by_rank[0][(ep, stage)]
    assert main["clipped"] and main["adapters_moved"] > 1e-3, main
    assert len([n for n in main["errors"] if "experts" in n and "lora_" in n]) == 8, sorted(main["errors"])
    worst = max(main["errors"].items(), key=lambda item: item[1])
    assert worst[1] < 1e-5, worst  # every adapter trained as one process, the frozen base untouched
    for results in by_rank:
        got = results[(ep, stage)]
        assert got["loss"] < 1e-5 and got["norm"] < 1e-5, got


def test_lora_adapter_on_split_experts_saves_for_an_unsplit_model_and_streams_merged(
    by_rank: list[dict[Any, Any]],
) -> None:
    for results in by_rank:
        assert results["reloaded"] < 1e-5, results["reloaded"]
        assert results["stream_names"] and results["stream"] < 1e-5, results["stream"]
