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

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.test_expert_parallel_engine import ACCUM, EPS, LR, WORLD_SIZE, _batches
from tests.helpers.moe_models import held_expert_share


MAX_NORM = 0.005  # the adapters' gradient norm is ~0.008: clipping acts on every step


CASES = [(ep, stage) for ep in (2, 4) for stage in (1, 2, 3)]
TARGETS = {
    "target_modules": ["q_proj", "shared_expert.up_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
}


QUANTIZABLE = {"hidden_size": 64, "shared_expert_intermediate_size": 64}
"""bitsandbytes' CPU kernel packs a 4-bit weight by blocks of 64 inputs: every `nn.Linear` needs 64 or more."""


def _base(**sizes: int) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(**{
        **dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, tie_word_embeddings=False, intermediate_size=40, moe_intermediate_size=24,
               shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        **sizes,
    })  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return model.float()


def _adapted(base: torch.nn.Module | None = None) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base if base is not None else _base(), LoraConfig(r=2, lora_alpha=4, **TARGETS))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make every adapter matter from the first forward
            torch.nn.init.normal_(param, std=0.1)
    return model


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _reference(model: torch.nn.Module | None = None) -> dict[str, Any]:
    model = model if model is not None else _adapted()
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


def _engine_run(
    ep: int, stage: int, rank: int, folder: str, model: torch.nn.Module | None = None, bf16: bool = False
) -> dict[str, Any]:
    import torch.distributed as dist

    import accelerate_zero

    model = model if model is not None else _adapted()
    optimizer = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=0.01, eps=EPS)
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 3000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": MAX_NORM,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
    }
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
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
    out["held"] = held_expert_share(engine) if engine.experts is not None else None
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
            "held": got["held"],
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
    out["bf16"] = _bf16(rank, folder, reference)
    out["qlora"] = _qlora(rank, folder)
    out["not floating point"] = _non_floating_experts_refused()
    return out


def _bf16(rank: int, folder: str, reference: dict[str, Any]) -> dict[str, Any]:
    """LoRA on split experts in bf16 at ep 2, stage 3 (the experts cut over their peers) against the same bf16 run
    without expert parallelism: both round to bf16 differently from fp32."""
    split, whole = _engine_run(2, 3, rank, folder, bf16=True), _engine_run(1, 3, rank, folder, bf16=True)
    errors = {n: (v.float() - whole["params"][n].float()).abs().max().item() for n, v in split["params"].items()}
    return {
        "loss": max(abs(a - b) for a, b in zip(split["losses"], whole["losses"], strict=True)),
        "fp32_gap": max(abs(a - b) for a, b in zip(whole["losses"], reference["losses"], strict=True)),
        "worst": max(errors.items(), key=lambda item: item[1], default=("(rank 0 compares)", 0.0)),
        "held": split["held"],
    }


def _quantized_adapted(folder: str) -> torch.nn.Module:
    """The same adapters on the base loaded in 4 bits (bitsandbytes NF4: its linear layers, the shared expert's and
    attention's, quantized; the fused experts and the router are not `nn.Linear` and stay fp32)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if torch.distributed.get_rank() == 0 and not (Path(folder) / "config.json").exists():
        _base(**QUANTIZABLE).save_pretrained(folder)
    torch.distributed.barrier()
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4, dtype=torch.float32)
    torch.manual_seed(0)  # peft draws LoRA A
    return _adapted(base.train())  # (bitsandbytes repacks a 4-bit weight for CPU inference in eval mode)


def _qlora(rank: int, folder: str) -> dict[str, Any]:
    """QLoRA on a MoE under expert parallelism (ep 2, stage 3) against the same 4-bit model in one process."""
    reference = _reference(_quantized_adapted(f"{folder}/base"))
    model = _quantized_adapted(f"{folder}/base")
    kinds = {type(m).__name__ for m in model.modules()}
    experts = [p.dtype for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "down_proj"))]
    got = _engine_run(2, 3, rank, folder, model=model)
    params = {n: v for n, v in got["params"].items() if n in reference["params"]}  # not the 4-bit quantization state
    errors = {n: (v.float() - reference["params"][n].float()).abs().max().item() for n, v in params.items()}
    return {
        "quantized": "Linear4bit" in kinds and experts and all(dtype == torch.float32 for dtype in experts),
        "loss": max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)),
        "worst": max(errors.items(), key=lambda item: item[1], default=("(rank 0 compares)", 0.0)),
        "lora_on_experts": sum("experts" in n and "lora_" in n for n in errors),
    }


def _non_floating_experts_refused() -> str:
    """Experts held in an integer dtype (quantized ones, which bitsandbytes does not make today) are refused by name."""
    import accelerate_zero

    model = _base()
    experts = model.model.layers[1].mlp.experts.down_proj
    experts.requires_grad_(False)
    experts.data = experts.data.to(torch.int8)
    config = {"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    try:
        accelerate_zero.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                                   config=config)  # fmt: skip
    except NotImplementedError as error:
        return str(error)
    return "initialized"


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all, WORLD_SIZE, str(tmp_path_factory.mktemp("ep_lora")), timeout=600)


@pytest.mark.parametrize(("ep", "stage"), CASES)
def test_lora_on_split_experts_equals_one_process(by_rank: list[dict[Any, Any]], ep: int, stage: int) -> None:
    main = by_rank[0][(ep, stage)]
    assert main["clipped"] and main["adapters_moved"] > 1e-3, main
    assert main["held"] == pytest.approx(1 / WORLD_SIZE if stage == 3 else 1 / ep), main  # the frozen experts
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


def test_lora_on_split_experts_in_bf16_equals_bf16_without_expert_parallelism(by_rank: list[dict[Any, Any]]) -> None:
    for results in by_rank:
        got = results["bf16"]
        assert got["held"] == pytest.approx(1 / WORLD_SIZE), got  # the frozen experts cut over their peers
        assert got["loss"] < 5e-3 and got["fp32_gap"] > 0, got  # agree far closer than either agrees with fp32
        assert got["worst"][1] < 2e-2, got  # bf16's rounding of adapter values below 2 (0.0078 an ulp)


def test_qlora_on_a_moe_trains_under_expert_parallelism(by_rank: list[dict[Any, Any]]) -> None:
    """bitsandbytes quantizes `nn.Linear` only: a 4-bit MoE keeps its fused experts in fp32, so they split and LoRA on
    them trains as without quantization, exact against one process; experts that are not floating point (quantized
    by some other means) are refused at initialize, naming the tensor."""
    assert by_rank[0]["qlora"]["lora_on_experts"] == 8, by_rank[0]["qlora"]  # rank 0 compares the weights
    for results in by_rank:
        got = results["qlora"]
        assert got["quantized"] and got["loss"] < 1e-5 and got["worst"][1] < 1e-5, got
        refused = results["not floating point"]
        assert "model.layers.1.mlp.experts" in refused and "torch.int8" in refused, refused
