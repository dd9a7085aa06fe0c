"""Which optimizer steps which layout (optim/kinds.py), the owner plan (engine/owner_plan.py), the optimizer chain
and DeepSpeed's Muon block (optim/chain.py, optim/muon.py): pure checks, one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from accelerate_zero.engine.owner_plan import plan_owners
from accelerate_zero.engine.shard_plan import plan_group
from accelerate_zero.optim.chain import OptimizerChain
from accelerate_zero.optim.kinds import StepKind, StepKindError, step_kind
from accelerate_zero.optim.muon import build_muon_with_adam, muon_block_errors


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(shape)) for shape in shapes]


class Lion(torch.optim.Optimizer):
    zero_elementwise = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1e-3})


class LoggingAdamW(torch.optim.AdamW):
    """A subclass may change the step: it is not assumed elementwise."""


class NeedsClosure(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any) -> None:  # type: ignore[override]
        closure()


def test_step_kinds() -> None:
    params = _params((3, 4))
    for elementwise in (torch.optim.AdamW(params, fused=True), torch.optim.SGD(params), torch.optim.Rprop(params)):
        assert step_kind(elementwise) is StepKind.ELEMENTWISE
    assert step_kind(Lion(params)) is StepKind.ELEMENTWISE
    for whole in (torch.optim.Adafactor(params), torch.optim.Muon(params), LoggingAdamW(params)):
        assert step_kind(whole) is StepKind.WHOLE_TENSORS
    with pytest.raises(StepKindError, match=r"torch.optim.lbfgs.LBFGS cannot train under accelerate_zero: its step"):
        step_kind(torch.optim.LBFGS(params))
    with pytest.raises(StepKindError, match="NeedsClosure cannot train .* requires a closure"):
        step_kind(NeedsClosure(params))


def test_owner_plan_keeps_whole_slices_local_and_balances_the_rest() -> None:
    shapes = [(7, 15), (15,), (15, 15), (3, 15), (3,)]
    plan = plan_group(shapes, bucket_numel=10**9, num_shards=3)
    (bucket,) = plan.buckets
    owners = plan_owners([(bucket, [0] * len(shapes))])
    assert sorted(p.slot.param_index for p in owners.params) == list(range(len(shapes)))
    for param in owners.params:
        assert sum(piece.numel for piece in param.pieces) == param.numel  # every element held exactly once
        holders = {piece.holder for piece in param.pieces}
        assert param.owner in holders
        if len(holders) == 1:
            assert not [m for m in owners.moves().values() for p, _ in m if p is param]  # nothing moves for it
    assert sum(owners.loads) == sum(p.numel for p in owners.params)
    assert owners.moved_numel() == sum(pc.numel for moves in owners.moves().values() for _, pc in moves) > 0
    stage0 = plan_owners([(plan_group(shapes, 10**9, 1).buckets[0], [0] * len(shapes))])
    assert {p.owner for p in stage0.params} == {0} and not stage0.moves_anything()


def test_owner_plan_only_takes_whole_tensor_groups() -> None:
    bucket = plan_group([(4, 4), (4,)], 10**9, 2).buckets[0]
    plan = plan_owners([(bucket, [None if slot.shape == (4,) else 1 for slot in bucket.slots])])
    assert [(p.shape, p.group) for p in plan.params] == [((4, 4), 1)]


def test_chain_shares_groups_and_state_with_its_optimizers() -> None:
    a, b = _params((2, 3), (3,))
    muon, adam = torch.optim.Muon([a], lr=0.02), torch.optim.AdamW([b], lr=1e-3)
    chain = OptimizerChain(muon, adam)
    assert chain.param_groups[0] is muon.param_groups[0] and chain.param_groups[1] is adam.param_groups[0]
    scheduler = torch.optim.lr_scheduler.StepLR(chain, step_size=1, gamma=0.5)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    chain.step()
    scheduler.step()
    assert muon.param_groups[0]["lr"] == 0.01 and adam.param_groups[0]["lr"] == 5e-4
    assert set(chain.state) == {a, b} and muon.state is chain.state is adam.state
    saved = chain.state_dict()
    fresh = OptimizerChain(torch.optim.Muon([a], lr=1.0), torch.optim.AdamW([b], lr=1.0))
    fresh.load_state_dict(saved)
    assert fresh.optimizers[0].param_groups[0] is fresh.param_groups[0]
    assert fresh.optimizers[1].param_groups[0]["lr"] == 5e-4 and fresh.optimizers[1].state is fresh.state
    with pytest.raises(ValueError, match="no closure"):
        chain.step(lambda: 0.0)


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 4)
        self.proj = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)


def test_deepspeed_muon_block() -> None:
    params = {"lr": 0.1, "muon_lr": 0.03, "momentum": 0.9, "betas": [0.8, 0.9], "adam_w_mode": False}
    chain = build_muon_with_adam(_Named(), params)
    muon, adam = chain.optimizers
    assert isinstance(muon, torch.optim.Muon) and type(adam) is torch.optim.Adam  # adam_w_mode false: L2
    assert [tuple(p.shape) for p in muon.param_groups[0]["params"]] == [(6, 4)]  # embed and lm_head go to Adam
    assert (muon.defaults["lr"], muon.defaults["momentum"], muon.defaults["weight_decay"]) == (0.03, 0.9, 0.0)
    assert (adam.defaults["lr"], adam.defaults["betas"], adam.defaults["eps"]) == (0.1, (0.8, 0.9), 1e-10)
    assert muon_block_errors({"nesterov": True, "per_head_muon": True, "ns_method": "fast"}) == [
        "optimizer.params.nesterov is not a key of DeepSpeed's Muon block. Accepted: lr, muon_lr, adam_lr, momentum, "
        "weight_decay, eps, betas, ns_method, adam_w_mode, torch_adam, fp32_optimizer_states, per_head_muon.",
        "optimizer.params.ns_method must be one of gram, standard, got 'fast'",
        "optimizer.params.per_head_muon=true: per-head orthogonalisation is not available (torch.optim.Muon "
        "orthogonalises each matrix whole); remove the key",
    ]
    conv = nn.Sequential(nn.Conv1d(2, 3, 2))
    with pytest.raises(ValueError, match=r"3\+ dimensions to Muon.*0.weight \(3, 2, 2\)"):
        build_muon_with_adam(conv, {})
