"""NVMe optimizer offload: same training (with accumulation), masters, optimizer state and gradients in files,
bounded residency, startup checks."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, max_param_diff, train_reference


STEPS, ACCUM, PER_RANK_BATCH, SUB_GROUP, BUFFERS, BUCKET = 4, 2, 3, 64, 3, 100


def _train(rank: int, world_size: int, nvme_path: str, stage: int) -> dict[str, Any]:
    import accelerate_zero
    from accelerate_zero.offload.nvme import rank_folder

    batches = make_batches(STEPS, ACCUM, PER_RANK_BATCH * world_size)
    reference = make_model()
    train_reference(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, clip=1.0)
    model = make_model()
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": BUFFERS}
    zero = {
        "stage": stage,
        "offload_optimizer": nvme,
        "sub_group_size": SUB_GROUP,
        "reduce_bucket_size": BUCKET,
        "stage3_param_persistence_threshold": 0,
    }
    engine = accelerate_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={"gradient_clipping": 1.0, "gradient_accumulation_steps": ACCUM, "zero_optimization": zero},
    )
    between_micro_steps = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            between_micro_steps.append(engine.memory_breakdown())
            engine.step()
    folder = rank_folder(nvme_path, rank)
    files_during = len(list(folder.glob("subgroup*.safetensors")))
    memory = engine.memory_breakdown()
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        diff = max_param_diff(model, reference)
    swapper = engine.sharded_optimizer.step_runner
    result = {
        "diff": diff,
        "files_during": files_during,
        "subgroups": len(swapper.subgroups),
        "peak_resident": swapper.peak_resident,
        "grad_peak_resident": engine.grad_store.peak_resident,
        "memory": memory,
        "between_micro_steps": between_micro_steps,
        "largest_bucket_shard": max(b.plan.shard_numel for b in engine.reducer.buckets),
        "shard": sum(s.end - s.start for s in engine.sharded_optimizer.slices),
    }
    engine.destroy()
    result["folder_gone"] = not folder.exists()
    return result


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_offload_matches_reference_and_keeps_state_on_disk(tmp_path: Path, stage: int) -> None:
    stale = tmp_path / "nvme" / "accelerate_zero" / "rank00000" / "subgroup99999.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left over by a killed job")
    for r in run_distributed(_train, 2, str(tmp_path / "nvme"), stage):
        assert r["diff"] < 1e-6, r["diff"]
        assert r["files_during"] == r["subgroups"] > 1  # the stale file was removed at start
        assert r["peak_resident"] <= BUFFERS
        memory = r["memory"]
        # between steps nothing of the masters or Adam state stays in RAM; it is on disk (12 bytes per element)
        assert memory["host_master_weights"] == 0 and memory["host_optimizer_states"] == 0
        # ... and the fp32 gradient shard went to disk as each bucket was reduced (4 more bytes per element):
        # while gradients accumulate RAM holds at most `buffer_count` bucket slices being written, after the
        # step none
        assert memory["nvme_bytes"] >= 16 * r["shard"]
        assert memory["host_gradients"] == 0
        in_flight = max(m["host_gradients"] for m in r["between_micro_steps"])
        assert in_flight <= BUFFERS * 4 * r["largest_bucket_shard"], in_flight
        assert 0 < r["grad_peak_resident"] <= BUFFERS
        assert r["folder_gone"]


def _mixed_precision(rank: int, world_size: int, nvme_path: str) -> dict[str, Any]:
    """bf16 with accumulation and clipping, and an fp16 overflow on one rank, with the optimizer in CPU memory and
    in files: only where state lives differs, so the weights must be bit-identical."""
    import accelerate_zero

    batches = make_batches(STEPS, ACCUM, PER_RANK_BATCH * world_size)
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": BUFFERS}
    out: dict[str, Any] = {}
    for precision, optimizer_class in (("bf16", torch.optim.SGD), ("fp16", torch.optim.AdamW)):
        weights = {}
        for device in ("cpu", "nvme"):
            model = make_model()
            offload = nvme if device == "nvme" else {"device": "cpu"}
            zero = {
                "stage": 3,
                "offload_optimizer": offload,
                "sub_group_size": SUB_GROUP,
                "reduce_bucket_size": BUCKET,
            }
            mixed = {"enabled": True} if precision == "bf16" else {"enabled": True, "initial_scale_power": 8}
            config = {
                "gradient_clipping": 1.0,
                "gradient_accumulation_steps": ACCUM,
                precision: mixed,
                "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0},
            }
            engine = accelerate_zero.initialize(model, optimizer_class(model.parameters(), lr=1e-2), config=config)
            for step in range(STEPS):
                for micro in range(ACCUM):
                    x, y = batches.rank_slice(step, micro, rank, world_size)
                    loss = torch.nn.functional.mse_loss(engine(x.to(engine.compute_dtype)).float(), y)
                    if precision == "fp16" and (step, micro, rank) == (1, 1, world_size - 1):
                        loss = loss * float("inf")  # this rank's gradient overflows: every rank skips the step
                    engine.backward(loss)
                    engine.step()
            with accelerate_zero.GatheredParameters(list(model.parameters())):
                weights[device] = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
            out[f"{precision}_skipped_{device}"] = engine.skipped_steps
            engine.destroy()
        out[f"{precision}_identical"] = torch.equal(weights["cpu"], weights["nvme"])
        out[f"{precision}_finite"] = bool(torch.isfinite(weights["nvme"]).all())
    return out


def test_nvme_gradients_change_nothing_in_mixed_precision(tmp_path: Path) -> None:
    for r in run_distributed(_mixed_precision, 3, str(tmp_path / "nvme")):
        assert r["bf16_identical"] and r["fp16_identical"] and r["bf16_finite"] and r["fp16_finite"], r
        assert r["fp16_skipped_cpu"] == r["fp16_skipped_nvme"] == 1 and r["bf16_skipped_nvme"] == 0, r


def test_nvme_path_checks_name_host_path_and_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_zero.offload import nvme

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(OSError, match="not a writable folder") as error:
        nvme.check_nvme_path(str(not_a_folder), 0, 1000)
    assert str(not_a_folder) in str(error.value)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 10))
    with pytest.raises(OSError, match=r"has 10 bytes free but rank 1 needs 12,000 bytes"):
        nvme.check_nvme_path(str(tmp_path / "ok"), 1, 1000)
