"""Stages 0, 1, 2 against a single-process reference trained on the full batch, at world sizes 1 to 4.

Every case trains the same tiny model with uneven shapes for several optimizer steps with gradient accumulation
and clipping on; the ZeRO run must end with the reference's parameters (fp32: max abs difference around 1e-6)
and with identical parameters on every rank. One spawned group per world size runs all cases.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.models import (
    make_batches,
    make_model,
    max_param_diff,
    param_groups,
    train_reference,
)


STEPS, GRAD_ACCUM, PER_RANK_BATCH, LR, CLIP = 6, 2, 3, 1e-2, 0.5
FP32_TOLERANCE = 5e-6


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    stage: int
    zero: dict = dataclasses.field(default_factory=dict)
    top: dict = dataclasses.field(default_factory=dict)
    groups: bool = False
    frozen: bool = False
    scheduler: bool = False
    grad_accum: int = GRAD_ACCUM
    optimizer: str = "adamw"
    """SGD cases catch gradient-scale errors that Adam's normalisation and active clipping would hide."""
    clip: float = CLIP


def _cases() -> list[Case]:
    cases = []
    for stage in (0, 1, 2):
        cases += [
            Case(f"s{stage}-small-buckets-overlap", stage, {"reduce_bucket_size": 64, "overlap_comm": True}),
            Case(
                f"s{stage}-one-bucket-sync-lazy-grads",
                stage,
                {"reduce_bucket_size": int(5e8), "overlap_comm": False, "contiguous_gradients": False},
                grad_accum=1,
                optimizer="sgd",
                clip=0.0,
            ),
            Case(
                f"s{stage}-allreduce-broadcast-prescale",
                stage,
                {
                    "reduce_scatter": False,
                    "allgather_partitions": False,
                    "allgather_bucket_size": 40,
                    "reduce_bucket_size": 100,
                },
                {"prescale_gradients": True, "gradient_predivide_factor": 2.0},
                optimizer="sgd",
                clip=5.0,
            ),
            Case(
                f"s{stage}-groups-frozen-scheduler",
                stage,
                {"reduce_bucket_size": 50},
                groups=True,
                frozen=True,
                scheduler=True,
            ),
            Case(f"s{stage}-grad-accum-4", stage, {"reduce_bucket_size": 30}, grad_accum=4, optimizer="sgd", clip=0.0),
        ]
    no_persist = {"stage3_param_persistence_threshold": 0}
    cases += [
        Case("s3-release-after-forward", 3, {**no_persist, "stage3_max_reuse_distance": 0}),
        Case("s3-biases-persistent-reuse", 3, {"stage3_param_persistence_threshold": 20}, optimizer="sgd", clip=0.0),
        Case(
            "s3-groups-frozen-scheduler",
            3,
            {**no_persist, "stage3_max_reuse_distance": 0},
            groups=True,
            frozen=True,
            scheduler=True,
        ),
        Case(
            "s3-prefetch-bounded-accum-4",
            3,
            {
                **no_persist,
                "stage3_prefetch_bucket_size": 120,
                "stage3_max_live_parameters": 300,
                "stage3_max_reuse_distance": 0,
            },
            grad_accum=4,
            optimizer="sgd",
            clip=0.0,
        ),
        Case(
            "s3-allreduce-fetch-lazy-grads",
            3,
            {
                **no_persist,
                "stage3_use_all_reduce_for_fetch_params": True,
                "contiguous_gradients": False,
                "overlap_comm": False,
            },
            optimizer="sgd",
            clip=5.0,
        ),
    ]
    cpu = {"offload_optimizer": {"device": "cpu"}}
    cases += [
        Case("s1-offload-optimizer", 1, {**cpu, "reduce_bucket_size": 64}),
        Case(
            "s2-offload-optimizer-sgd-accum-4",
            2,
            {**cpu, "reduce_bucket_size": 64},
            grad_accum=4,
            optimizer="sgd",
            clip=0.0,
        ),
        Case(
            "s3-offload-optimizer-and-params",
            3,
            {**cpu, **no_persist, "offload_param": {"device": "cpu"}, "stage3_max_reuse_distance": 0},
            groups=True,
            frozen=True,
            scheduler=True,
        ),
        Case("s3-offload-params-sgd", 3, {**no_persist, "offload_param": {"device": "cpu"}}, optimizer="sgd"),
    ]
    return cases


def _build(case: Case, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(seed)
    if case.frozen:
        model.inp.weight.requires_grad_(False)
    params = param_groups(model, LR, 0.1) if case.groups else [p for p in model.parameters() if p.requires_grad]
    if case.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if case.scheduler else None
    return model, optimizer, scheduler


def _run_case(case: Case, rank: int, world_size: int) -> dict[str, float]:
    import accelerate_zero

    batches = make_batches(STEPS, case.grad_accum, PER_RANK_BATCH * world_size)
    reference, ref_optimizer, ref_scheduler = _build(case)
    train_reference(reference, ref_optimizer, batches, clip=case.clip, scheduler=ref_scheduler)

    model, optimizer, scheduler = _build(case)
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK_BATCH,
        "gradient_accumulation_steps": case.grad_accum,
        "gradient_clipping": case.clip,
        "zero_optimization": {"stage": case.stage, **case.zero},
        **case.top,
    }
    engine = accelerate_zero.initialize(model, optimizer, config=config, lr_scheduler=scheduler)
    for step in range(STEPS):
        for micro in range(case.grad_accum):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    with accelerate_zero.GatheredParameters(model.parameters()):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        max_diff = max_param_diff(model, reference)
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    engine.destroy()
    return {
        "max_diff": max_diff,
        "rank_spread": max((g - gathered[0]).abs().max().item() for g in gathered),
        "global_steps": engine.global_steps,
        "lr": engine.get_lr()[0],
        "ref_lr": ref_optimizer.param_groups[0]["lr"],
    }


def _all_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {case.name: _run_case(case, rank, world_size) for case in _cases()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stages_match_single_process_reference(world_size: int) -> None:
    results = run_distributed(_all_cases, world_size)
    failures = []
    for case in _cases():
        for rank, by_case in enumerate(results):
            r = by_case[case.name]
            if not r["max_diff"] <= FP32_TOLERANCE:
                failures.append(f"{case.name} rank {rank}: max |param - reference| = {r['max_diff']:.3g}")
            if r["rank_spread"] != 0.0:
                failures.append(f"{case.name} rank {rank}: parameters differ across ranks by {r['rank_spread']:.3g}")
            if r["global_steps"] != STEPS or r["lr"] != pytest.approx(r["ref_lr"]):
                failures.append(f"{case.name} rank {rank}: steps/lr {r['global_steps']}/{r['lr']} vs {r['ref_lr']}")
    assert not failures, "\n".join(failures)
