"""The model zoo at stage 3 with every parameter sharded (`stage3_param_persistence_threshold: 0`), 2 ranks.

Per architecture of `tests.helpers.models.ZOO` (decoder-only, MoE, encoder-decoder, encoder classification, vision):
- a sub-model call (`model.base_model(...)`, `get_encoder()(...)` for encoder-decoder ones) equals the unsharded
  model's;
- greedy `generate` with a different prompt and length on every rank equals the unsharded model's (generative ones);
- training (SGD, fp32, gradient_accumulation_steps 2, no clipping) equals a one-process reference that averages the
  ranks' half-batch gradients: the reference computes each rank's loss on its half and back-propagates their mean,
  so only the fp32 summation order of the two halves differs.

Every architecture runs inside ONE spawned group, so the matrix costs one start-up; each rank returns a result per
architecture (an error's traceback instead when one raised) and the assertions run in pytest. The process-group
timeout is short (tests/helpers/dist.py), so a rank waiting for a collective the other never issues fails the run
instead of hanging. Dropout is off (eval mode) for both runs, so they compute the same function.
"""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.models import ZOO, ZOO_IMAGE, ZOO_LABELS, ZOO_VOCAB, ZooModel


WORLD_SIZE, STEPS, GRAD_ACCUM, PER_RANK_BATCH, SEQ, LR = 2, 2, 2, 2, 8, 0.1
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
CONFIG = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 0.0, "zero_optimization": ZERO3}
# Both runs use the same fp32 kernels on the same data; the sharded one sums the two ranks' gradients in another
# order and averages with one more rounding: a few ulp of the gradients (~1e-7 relative), times LR and STEPS.
TRAIN_ATOL = 1e-6
# Parameters are gathered bit-exactly: a sub-model's forward is the unsharded computation itself.
FORWARD_ATOL = 1e-6

KNOWN_LIMITS: dict[str, str] = {}
"""Architectures that cannot pass for a reason outside the engine, with that reason (none so far)."""


def _build(spec: ZooModel) -> torch.nn.Module:
    torch.manual_seed(0)
    model = spec.build()
    if spec.skew:
        _skew_routing(model)
    return model.eval()


def _skew_routing(model: torch.nn.Module) -> None:
    """Routes the lower half of the vocabulary to experts 0-1 and the upper half to experts 2-3, in every layer.

    Embedding dimension 0 is +3 for low tokens and -3 for high ones, the routers look at that dimension only, with
    opposite signs for the two expert pairs: after the RMS norm it dominates the hidden state.
    """
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, 0] = torch.where(torch.arange(embed.shape[0]) < ZOO_VOCAB // 2, 3.0, -3.0)
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.zero_()
            half = gate.shape[0] // 2
            gate[:half, 0], gate[half:, 0] = 4.0, -4.0


def _batch(spec: ZooModel, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One micro-step's batch for both ranks (rank r takes rows [r*B, (r+1)*B))."""
    rows = PER_RANK_BATCH * WORLD_SIZE
    if spec.kind == "vision":
        return {
            "pixel_values": torch.randn(rows, 3, ZOO_IMAGE, ZOO_IMAGE, generator=gen),
            "labels": torch.randint(0, ZOO_LABELS, (rows,), generator=gen),
        }
    if spec.skew:  # each rank's tokens come from its own half of the vocabulary
        low = torch.randint(3, ZOO_VOCAB // 2, (PER_RANK_BATCH, SEQ), generator=gen)
        high = torch.randint(ZOO_VOCAB // 2, ZOO_VOCAB, (PER_RANK_BATCH, SEQ), generator=gen)
        tokens = torch.cat([low, high])
    else:
        tokens = torch.randint(3, ZOO_VOCAB, (rows, SEQ), generator=gen)  # 0-2: pad/bos/eos in most configs
    if spec.kind == "causal":
        return {"input_ids": tokens, "labels": tokens}
    if spec.kind == "seq2seq":
        return {"input_ids": tokens, "labels": torch.randint(3, ZOO_VOCAB, (rows, SEQ - 3), generator=gen)}
    return {"input_ids": tokens, "labels": torch.randint(0, ZOO_LABELS, (rows,), generator=gen)}


def _half(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for k, v in batch.items()}


def _train(rank: int, spec: ZooModel, model: torch.nn.Module, reference: torch.nn.Module, engine: Any) -> dict:
    import accelerate_zero

    gen = torch.Generator().manual_seed(7)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        for _ in range(GRAD_ACCUM):
            batch = _batch(spec, gen)
            # The reference: the mean of the ranks' half-batch losses, i.e. the mean of their gradients.
            halves = [reference(**_half(batch, r)).loss for r in range(WORLD_SIZE)]
            (sum(halves) / WORLD_SIZE / GRAD_ACCUM).backward()
            loss = engine(**_half(batch, rank)).loss
            engine.backward(loss)
            engine.step()
            losses.append((loss.item(), halves[rank].item()))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        diff = max(
            (p.detach() - r.detach()).abs().max().item()
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )
        moved = max(
            (p.detach() - q.detach()).abs().max().item()
            for p, q in zip(model.parameters(), _build(spec).parameters(), strict=True)
        )
    return {"diff": diff, "moved": moved, "loss_diff": max(abs(a - b) / max(1.0, abs(b)) for a, b in losses)}


def _submodel(rank: int, spec: ZooModel, model: torch.nn.Module, reference: torch.nn.Module) -> float:
    gen = torch.Generator().manual_seed(50 + rank)
    batch = _half(_batch(spec, gen), rank)
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def call(m: torch.nn.Module) -> torch.Tensor:
        sub = m.get_encoder() if spec.kind == "seq2seq" else m.base_model
        return sub(**inputs).last_hidden_state

    with torch.no_grad():
        return (call(model) - call(reference)).abs().max().item()


def _generate(rank: int, spec: ZooModel, model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + rank)
    low, high = (
        (3, ZOO_VOCAB) if not spec.skew else ((3, ZOO_VOCAB // 2) if rank == 0 else (ZOO_VOCAB // 2, ZOO_VOCAB))
    )
    prompt = torch.randint(low, high, (1, 3 + 2 * rank), generator=gen)  # a different length on every rank
    length = 3 + 3 * rank  # ranks finish at different steps: the early ones keep stepping (synced_gpus)
    kwargs = {"max_new_tokens": length, "min_new_tokens": length, "do_sample": False, "num_beams": 1}
    kwargs["pad_token_id"] = 0
    with torch.no_grad():
        sharded = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        expected = reference.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    return {
        "same": torch.equal(sharded, expected),
        "new": sharded.shape[1] - (0 if spec.kind == "seq2seq" else 3 + 2 * rank),
    }


def _experts_used(spec: ZooModel, reference: torch.nn.Module, rank: int) -> list[list[int]]:
    """Per layer, the experts the reference routes this rank's tokens to (the skew's evidence)."""
    gen = torch.Generator().manual_seed(7)
    tokens = _half(_batch(spec, gen), rank)["input_ids"]
    used = []
    with torch.no_grad():
        logits = reference(input_ids=tokens, output_router_logits=True).router_logits
        for layer_logits in logits:
            top = layer_logits.topk(reference.config.num_experts_per_tok, dim=-1).indices
            used.append(sorted(set(top.flatten().tolist())))
    return used


def _check_one(rank: int, name: str, spec: ZooModel) -> dict[str, Any]:
    import accelerate_zero

    model = _build(spec)
    reference = copy.deepcopy(model)
    engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=LR), config=CONFIG)
    try:
        out: dict[str, Any] = {"submodel_diff": _submodel(rank, spec, model, reference)}
        if spec.kind in ("causal", "seq2seq"):
            out["generate"] = _generate(rank, spec, model, reference)
        if spec.skew:
            out["experts"] = _experts_used(spec, reference, rank)
        out.update(_train(rank, spec, model, reference, engine))
        return out
    finally:
        engine.destroy()


def _all_architectures(rank: int, world_size: int) -> dict[str, Any]:
    assert world_size == WORLD_SIZE
    results: dict[str, Any] = {}
    for name, spec in ZOO.items():
        clock = time.perf_counter()
        try:
            results[name] = _check_one(rank, name, spec)
        except Exception:
            # Both ranks run the same code on the same shapes, so they fail at the same point and the group
            # stays usable for the next architecture.
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - clock
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def zoo_results() -> list[dict[str, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all_architectures, WORLD_SIZE)


def _result(zoo_results: list[dict[str, Any]], name: str, rank: int) -> dict[str, Any]:
    if name in KNOWN_LIMITS:
        pytest.xfail(KNOWN_LIMITS[name])
    result = zoo_results[rank][name]
    assert "error" not in result, result["error"]
    return result


def test_zoo_has_the_required_architectures() -> None:
    kinds = [spec.kind for spec in ZOO.values()]
    assert len(ZOO) >= 15 and {"causal", "seq2seq", "classify", "vision"} <= set(kinds)
    assert any(spec.skew for spec in ZOO.values())


@pytest.mark.parametrize("name", list(ZOO))
def test_training_matches_reference(zoo_results: list[dict[str, Any]], name: str) -> None:
    for rank in range(WORLD_SIZE):
        r = _result(zoo_results, name, rank)
        assert r["moved"] > 100 * TRAIN_ATOL, r  # training changed the weights: the comparison means something
        assert r["diff"] < TRAIN_ATOL, r
        assert r["loss_diff"] < TRAIN_ATOL, r  # relative: the losses are ~4, where one ulp is 5e-7


@pytest.mark.parametrize("name", list(ZOO))
def test_submodel_call_matches_unsharded(zoo_results: list[dict[str, Any]], name: str) -> None:
    for rank in range(WORLD_SIZE):
        r = _result(zoo_results, name, rank)
        assert r["submodel_diff"] < FORWARD_ATOL, r


@pytest.mark.parametrize("name", [n for n, s in ZOO.items() if s.kind in ("causal", "seq2seq")])
def test_generate_matches_unsharded(zoo_results: list[dict[str, Any]], name: str) -> None:
    for rank in range(WORLD_SIZE):
        r = _result(zoo_results, name, rank)
        assert r["generate"]["same"], r
        assert r["generate"]["new"] >= 3 + 3 * rank, r


def test_skewed_routing_sends_the_ranks_to_disjoint_experts(zoo_results: list[dict[str, Any]]) -> None:
    for name in [n for n, s in ZOO.items() if s.skew]:
        used = [_result(zoo_results, name, rank)["experts"] for rank in range(WORLD_SIZE)]
        for layer in range(len(used[0])):
            assert not set(used[0][layer]) & set(used[1][layer]), (name, used)
