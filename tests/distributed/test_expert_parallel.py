"""Expert parallelism for transformers' fused MoE layers (issue 41; accelerate_zero/engine/experts): each rank of an expert
group keeps 1/ep of every layer's experts and tokens travel to them and back with uneven all-to-alls.

The experts run as transformers computes them: Qwen3-MoE with its default grouped matmuls, Mixtral with the eager
loop over the experts hit (which leaves an expert no token reached out of the graph).
One spawned group of 4 ranks runs, for expert-parallel sizes 2 (two expert groups: experts' gradients summed over
the peers that hold the same experts) and 4 (one group), on a tiny Qwen3-MoE and a tiny Mixtral (top-2), and on a
top-1 Mixtral where rank 0 routes every one of its tokens to expert 0 (so the other experts get nothing from it, and
at ep 4 ranks 1-3 receive nothing from rank 0), and one where every rank does (at ep 4 ranks 1-3 compute nothing,
and their experts still take part in backward with a gradient of 0): each rank's forward and backward on its quarter of the batch, the
gradients reduced as the engine will ([Note: gradients of split experts] in engine/experts/parallel.py), against one
process on the full batch: the loss, every dense gradient, and each rank's slice of every expert gradient (fp32,
within 1e-5). Each case also counts the bytes the exchanges moved.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


WORLD_SIZE = 4
MICRO, LENGTH = 2, 9
EXPERT_SIZES = (2, 4)
MODELS = ("qwen3_moe", "mixtral", "mixtral_top1_one_expert", "mixtral_top1_all_to_expert_zero", "llama4", "dbrx",
          "gpt_oss")  # fmt: skip
"""The last three: each other way a block calls its experts (Llama-4's replicated rows, DBRX's `[E * F, H]` matrices in
a child, gpt-oss's argument names and expert biases), tiny models from tests/helpers/moe_models.py."""


def _model(kind: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    if kind in ("llama4", "dbrx", "gpt_oss"):
        from tests.helpers.moe_models import tiny_moe

        return tiny_moe(kind).train()
    torch.manual_seed(0)
    if kind in ("qwen3_moe", "qwen3_moe_six"):  # six experts: split over 3 ranks (an odd world)
        config = Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                num_experts=6 if kind == "qwen3_moe_six" else 4, num_experts_per_tok=2,
                                norm_topk_prob=True)  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    else:
        top_k = 1 if kind.startswith("mixtral_top1") else 2
        config = MixtralConfig(**common, intermediate_size=40, num_local_experts=4, num_experts_per_tok=top_k,
                               experts_implementation="eager")  # fmt: skip
        model = MixtralForCausalLM(config)
    for param in model.parameters():  # transformers initialises expert tensors small: make every path count
        torch.nn.init.normal_(param, std=0.2)
    return model.float()


def _force_expert_zero(model: torch.nn.Module, rows: int | None) -> None:
    """The first `rows` tokens (None: all) each layer routes go to expert 0 (the top-1 model's "one expert" rank, or
    every rank: then at ep 4 ranks 1-3 hold experts no token reaches in the whole group)."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        logits, scores, index = output
        index = index.clone()
        index[slice(rows)] = 0
        return logits, scores, index

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (WORLD_SIZE * MICRO, LENGTH), generator=torch.Generator().manual_seed(3))


def _reference(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = _model(kind)
    if kind == "mixtral_top1_one_expert":
        _force_expert_zero(model, MICRO * LENGTH)  # rank 0's tokens come first in the full batch
    if kind == "mixtral_top1_all_to_expert_zero":
        _force_expert_zero(model, None)
    tokens = _tokens()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _expert_parallel(kind: str, ep: int, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.experts.parallel import split_experts
    from accelerate_zero.engine.groups import init_data_parallel_group
    from accelerate_zero.engine.layout import LayoutPlan, build_sharding_layout
    from accelerate_zero.engine.nodes import NodeLayout

    world = init_data_parallel_group(torch.device("cpu"))
    layout = build_sharding_layout(world, LayoutPlan(NodeLayout(WORLD_SIZE, WORLD_SIZE, "one node"), WORLD_SIZE,
                                                     expert_size=ep))  # fmt: skip
    model = _model(kind)
    stats = CommStats()
    placement = split_experts(model, layout.expert, stats, layout.expert_peers)
    if kind == "mixtral_top1_one_expert" and rank == 0:
        _force_expert_zero(model, MICRO * LENGTH)
    if kind == "mixtral_top1_all_to_expert_zero":
        _force_expert_zero(model, None)
    tokens = _tokens()[rank * MICRO : (rank + 1) * MICRO]
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    experts = {id(p) for p in placement.expert_parameters()}
    for param in model.parameters():  # [Note: gradients of split experts]
        if id(param) in experts:
            if layout.expert_peers is not None:
                dist.all_reduce(param.grad, group=layout.expert_peers.group)
        else:
            dist.all_reduce(param.grad)
        param.grad /= WORLD_SIZE
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    placement.remove()
    rows = {}  # split parameter -> the rows of the whole one it holds
    for layer in placement.layers:
        start, stop = placement.ranges[layer.name]
        for name, param in zip(layer.param_names, layer.params(), strict=True):
            per_expert = param.shape[0] // (stop - start)
            rows[f"{layer.name}.{name}"] = (start * per_expert, stop * per_expert)
    return {
        "loss": mean_loss.item() / WORLD_SIZE,
        "grads": grads,
        "ranges": rows,
        "bytes": stats.as_dict()["total"]["payload_bytes"],
    }


def _compare(kind: str, ep: int, rank: int, world_size: int) -> dict[str, Any]:
    loss, reference = _reference(kind)
    got = _expert_parallel(kind, ep, rank)
    errors = {}
    for name, grad in got["grads"].items():
        expected = reference[name]
        if name in got["ranges"]:
            start, stop = got["ranges"][name]
            expected = expected[start:stop]
        errors[name] = (grad - expected).abs().max().item()
    split = [n for n in errors if n in got["ranges"]]
    return {"loss_error": abs(got["loss"] - loss), "errors": errors, "split": split, "bytes": got["bytes"]}


def _all(rank: int, world_size: int) -> dict[Any, Any]:
    return {(kind, ep): _compare(kind, ep, rank, world_size) for ep in EXPERT_SIZES for kind in MODELS}


@pytest.fixture(scope="module")
def by_rank() -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all, WORLD_SIZE)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("ep", EXPERT_SIZES)
def test_expert_parallel_layers_equal_one_process(by_rank: list[dict[Any, Any]], kind: str, ep: int) -> None:
    for rank, results in enumerate(by_rank):
        got = results[(kind, ep)]
        assert got["loss_error"] < 1e-5, (rank, got["loss_error"])
        # gate_up_proj and down_proj of 2 layers (gpt-oss: and their biases; DBRX: w1, v1, w2)
        assert len(got["split"]) == {"gpt_oss": 8, "dbrx": 6}.get(kind, 4), got["split"]
        worst = max(got["errors"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-5, (rank, kind, ep, worst)
        assert got["bytes"] > 0
