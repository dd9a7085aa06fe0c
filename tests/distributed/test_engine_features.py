"""Mixed precision, fp16 overflow handling, and the bytes the engine holds and moves, at 2 and 3 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, round_to_bf16, train_reference, update_error


STEPS, PER_RANK_BATCH = 5, 4
BF16_ACCUMULATION = 2
# bf16 masters against the fp32 reference, error / update ([Note: the bf16 bound at stage 3] in
# test_stage3_llama.py), measured at stages 0-2: 0.30% at 2 ranks, 0.24% at 3. Bugs on the reference: no clip
# 6.5% / 4.5%, a lost micro-step 7.2% / 5.0%. Bound 3%: 10x the largest measured error, below the smallest bug
# (both sides asserted). The old check (max |bf16 param - fp32|) read 3.4e-3 against a bound of 1e-2: bf16's own
# rounding of the weights, which a lost micro-step would not have crossed.
BF16_BOUND = 0.03


def _config(stage: int, **top: Any) -> dict:
    zero = top.pop("zero", {})
    return {
        "train_micro_batch_size_per_gpu": PER_RANK_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **zero},
        **top,
    }


def _train(engine: Any, batches: Any, rank: int, world_size: int, inject: tuple[int, int] | None = None) -> list:
    snapshots = []
    for step in range(len(batches.inputs)):
        x, y = batches.rank_slice(step, 0, rank, world_size)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.compute_dtype)).float(), y)
        if inject == (step, rank):
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        snapshots.append(torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()]))
    return snapshots


def _bf16(stage: int, rank: int, world_size: int, folder: str) -> dict[str, float]:
    """bf16 with fp32 masters against the fp32 reference from the same bf16-rounded start, as an error relative to
    the update ([Note: the bf16 bound at stage 3] in test_stage3_llama.py); and what two bugs do to the reference."""
    import accelerate_zero
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict

    batches = make_batches(STEPS, BF16_ACCUMULATION, PER_RANK_BATCH * world_size)
    # SGD: Adam's nearly sign-like update turns bf16 noise on tiny gradients into full-size steps.
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = _config(stage, bf16={"enabled": True})
    config["gradient_accumulation_steps"] = BF16_ACCUMULATION
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    for step in range(STEPS):
        for micro in range(BF16_ACCUMULATION):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
            engine.step()
    master = torch.cat([s.master.reshape(-1) for s in engine.sharded_optimizer.slices])
    out = {
        "param_dtype_bf16": float(all(p.dtype == torch.bfloat16 for p in model.parameters())),
        "master_dtype_fp32": float(master.dtype == torch.float32),
    }
    engine.save_checkpoint(f"{folder}/bf16-s{stage}", tag="end")
    if rank != 0:
        return out
    start = {k: v.detach().clone() for k, v in round_to_bf16(make_model()).named_parameters()}

    def reference(**bug: Any) -> dict[str, torch.Tensor]:
        ref = round_to_bf16(make_model())
        train_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), batches, **bug)
        return ref.state_dict()

    expected = reference(clip=1.0)
    out["bf16 masters"] = update_error(consolidated_state_dict(f"{folder}/bf16-s{stage}/end"), expected, start)
    out["bug: no clip"] = update_error(reference(clip=0.0), expected, start)
    out["bug: a lost micro-step"] = update_error(reference(clip=1.0, lose=(STEPS - 1, 1)), expected, start)
    return out


def _fp16_overflow(stage: int, rank: int, world_size: int) -> dict[str, float]:
    import accelerate_zero

    batches = make_batches(STEPS, 1, PER_RANK_BATCH * world_size)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
    engine = accelerate_zero.initialize(model, optimizer, config=_config(stage, fp16=fp16), lr_scheduler=scheduler)
    # The overflow happens on the last rank only: every rank must skip the step.
    snapshots = _train(engine, batches, rank, world_size, inject=(2, world_size - 1))
    return {
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.loss_scale,
        "unchanged_on_overflow": float(torch.equal(snapshots[1], snapshots[2])),
        "changed_otherwise": float(not torch.equal(snapshots[2], snapshots[3])),
        "lr": optimizer.param_groups[0]["lr"],
        "finite": float(all(torch.isfinite(s).all() for s in snapshots)),
    }


def _comm_and_memory(stage: int, rank: int, world_size: int) -> dict[str, Any]:
    import accelerate_zero

    batches = make_batches(2, 2, PER_RANK_BATCH * world_size)
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    config = _config(stage, zero={"reduce_bucket_size": 10**9})
    config["gradient_accumulation_steps"] = 2
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    x, y = batches.rank_slice(0, 0, rank, world_size)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    # Gradient traffic only: stages 2-3 also check the ranks' positions in a few bytes ([Note: ranks out of step]).
    non_boundary = sum(v["bytes_per_rank"] for k, v in engine.comm_stats().items() if k not in ("total", "progress"))
    x, y = batches.rank_slice(0, 1, rank, world_size)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    before_step = engine.memory_breakdown()
    engine.step()
    stats = engine.comm_stats()
    padded = sum(g.plan.numel for g in engine.groups)
    return {
        "numel": numel,
        "padded": padded,
        "non_boundary_bytes": non_boundary,
        "stats": stats,
        "memory": engine.memory_breakdown(),
        "memory_before_step": before_step,
    }


def _offload_memory(rank: int, world_size: int) -> dict[str, Any]:
    import accelerate_zero

    batches = make_batches(1, 1, PER_RANK_BATCH * world_size)
    model = make_model()
    config = _config(2, zero={"offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 10**9})
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    x, y = batches.rank_slice(0, 0, rank, world_size)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    fused = all(group["fused"] for group in engine.optimizer.param_groups)
    return {"memory": engine.memory_breakdown(), "padded": sum(g.plan.numel for g in engine.groups), "fused": fused}


def _all_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out = {"offload": _offload_memory(rank, world_size)}
    for stage in (0, 1, 2):
        out[f"bf16-s{stage}"] = _bf16(stage, rank, world_size, folder)
        out[f"fp16-s{stage}"] = _fp16_overflow(stage, rank, world_size)
        out[f"comm-s{stage}"] = _comm_and_memory(stage, rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    folder = str(tmp_path_factory.mktemp(f"features{request.param}"))
    return request.param, run_distributed(_all_checks, request.param, folder)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_keeps_16bit_params_fp32_master_and_tracks_reference(results: Any, stage: int) -> None:
    _, by_rank = results
    for r in by_rank:
        got = r[f"bf16-s{stage}"]
        assert got["param_dtype_bf16"] == 1.0 and got["master_dtype_fp32"] == 1.0
    got = by_rank[0][f"bf16-s{stage}"]
    print(f"stage {stage} bf16 masters and bugs, error / update:", got)
    assert got["bf16 masters"] < BF16_BOUND, got
    assert min(got["bug: no clip"], got["bug: a lost micro-step"]) > BF16_BOUND, got  # the bound catches them


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(results: Any, stage: int) -> None:
    _, by_rank = results
    for r in by_rank:
        got = r[f"fp16-s{stage}"]
        assert got["skipped_steps"] == 1
        assert got["loss_scale"] == 2.0**7
        assert got["unchanged_on_overflow"] == 1.0 and got["changed_otherwise"] == 1.0 and got["finite"] == 1.0
        assert got["lr"] == pytest.approx(1e-2 * 0.5 ** (STEPS - 1))  # the scheduler did not step on overflow


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bytes_moved_per_step_match_zero_volume(results: Any, stage: int) -> None:
    world_size, by_rank = results
    for r in by_rank:
        stats, padded = r[f"comm-s{stage}"]["stats"], r[f"comm-s{stage}"]["padded"]
        ring = (world_size - 1) / world_size
        scatter = ring  # a ring reduce-scatter on gloo too ([Note: reduce-scatter on gloo])
        if stage < 2:
            assert r[f"comm-s{stage}"]["non_boundary_bytes"] == 0  # stages 0/1 accumulate locally
        else:
            assert r[f"comm-s{stage}"]["non_boundary_bytes"] == pytest.approx(4 * padded * scatter)
        if stage == 0:
            assert stats["all_reduce"]["bytes_per_rank"] == pytest.approx(2 * 4 * padded * ring)
            assert "all_gather" not in stats
        else:
            micro_steps_reduced = 2 if stage == 2 else 1
            assert stats["reduce_scatter"]["bytes_per_rank"] == pytest.approx(
                micro_steps_reduced * 4 * padded * scatter
            )
            assert stats["all_gather"]["bytes_per_rank"] == pytest.approx(4 * padded * ring)
            # The squared gradient norm (fp64) and every rank's micro-step counter ([Note: ranks out of step]).
            assert stats["all_reduce"]["payload_bytes"] == 8 * (1 + world_size)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_held_shrinks_by_stage(results: Any, stage: int) -> None:
    world_size, by_rank = results
    for r in by_rank:
        got = r[f"comm-s{stage}"]
        memory, padded = got["memory"], got["padded"]
        shard = padded if stage == 0 else padded // world_size
        assert memory["parameters"] == 4 * padded
        assert memory["master_weights"] == 0  # fp32: the master shard is a view of the parameters
        # Between steps no stage holds a gradient ([Note: gradients live from the first backward to the optimizer
        # step]); before the step, the full buffer (stages 0/1) or the shard (stage 2).
        assert memory["gradients"] == 0
        assert got["memory_before_step"]["gradients"] == 4 * (shard if stage == 2 else padded)
        # exp_avg and exp_avg_sq per shard element, plus one scalar step tensor per bucket
        assert 8 * shard <= memory["optimizer_states"] <= 8 * shard + 64
        apart = ("total", "communication_buffers_peak", "cached_buffers")  # not held for training: not in total
        assert memory["total"] == sum(memory[k] for k in memory if k not in apart)


def test_offloaded_optimizer_state_is_held_on_the_host(results: Any) -> None:
    world_size, by_rank = results
    for r in by_rank:
        memory, shard = r["offload"]["memory"], r["offload"]["padded"] // world_size
        assert r["offload"]["fused"]  # the CPU step uses torch's fused kernel
        assert memory["master_weights"] == memory["optimizer_states"] == memory["gradients"] == 0
        assert memory["host_master_weights"] == 4 * shard and memory["host_gradients"] == 4 * shard
        assert 8 * shard - 64 <= memory["host_optimizer_states"] <= 8 * shard + 64
