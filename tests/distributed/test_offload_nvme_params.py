"""NVMe parameter offload (stage 3): same training as the reference, shards in files, bounded residency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, max_param_diff, train_reference


STEPS, PER_RANK_BATCH, BUFFERS = 4, 3, 2

# name -> (offload_optimizer block or None, offload_param extras)
CASES: dict[str, tuple[dict | None, dict]] = {
    "params nvme, optimizer cpu": ({"device": "cpu"}, {}),
    "params nvme, optimizer nvme": ({"device": "nvme"}, {}),
    "params nvme, no optimizer offload": (None, {}),
    "params nvme beyond max_in_cpu=120, optimizer cpu": ({"device": "cpu"}, {"max_in_cpu": 120}),
}


def _initialize_with_chunks(*args: Any, **kwargs: Any) -> Any:
    """`accelerate_zero.initialize` with host buffers cut from shared chunks, as on a GPU (ChunkedHostMemory)."""
    import accelerate_zero
    import accelerate_zero.engine.assemble as assemble_module
    from accelerate_zero.offload.host_memory import ChunkedHostMemory

    original, assemble_module.HostMemory = assemble_module.HostMemory, ChunkedHostMemory
    try:
        return accelerate_zero.initialize(*args, **kwargs)
    finally:
        assemble_module.HostMemory = original


def _train_case(rank: int, world_size: int, nvme_path: str, name: str) -> dict[str, Any]:
    import accelerate_zero
    from accelerate_zero.offload.nvme_params import param_rank_folder

    optimizer_block, param_extras = CASES[name]
    batches = make_batches(STEPS, 1, PER_RANK_BATCH * world_size)
    reference = make_model()
    train_reference(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, clip=1.0)
    model = make_model()
    path = str(Path(nvme_path) / name.replace(" ", "_").replace(",", ""))
    params = {"device": "nvme", "nvme_path": path, "buffer_count": BUFFERS, "max_in_cpu": 0, **param_extras}
    zero: dict[str, Any] = {"stage": 3, "offload_param": params, "stage3_param_persistence_threshold": 0}
    if optimizer_block is not None:
        zero["offload_optimizer"] = (
            {**optimizer_block, "nvme_path": path} if optimizer_block["device"] == "nvme" else optimizer_block
        )
        zero["sub_group_size"] = 64
    # The GPU's host-memory layout at 3 ranks, the CPU's own at 2: both are real.
    initialize = _initialize_with_chunks if world_size == 3 else accelerate_zero.initialize
    engine = initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={"gradient_clipping": 1.0, "zero_optimization": zero},
    )
    chunked = bool(engine.host_memory.chunks)
    folder = param_rank_folder(path, rank)
    store = engine.shard_store
    for step in range(STEPS):
        x, y = batches.rank_slice(step, 0, rank, world_size)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    memory = engine.memory_breakdown()
    result = {
        "files_during": sorted(p.name for p in folder.glob("*.bin")),
        "swapped_numel": sum(entry.flat.plan.shard_numel for entry in store.shards.values()),
        "all_numel": sum(flat.plan.shard_numel for unit in engine.units for flat in unit.flats),
        "element_size": next(iter(store.shards.values())).flat.shard.element_size(),
        "peak_resident": store.peak_resident,
        "host_parameters": memory["host_parameters"],
        "nvme_bytes": memory["nvme_bytes"],
        "chunked": chunked,
    }
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        result["diff"] = max_param_diff(model, reference)
    engine.destroy()
    result["folder_gone"] = not folder.exists()
    return result


def _modify_through_gathered(rank: int, world_size: int, nvme_path: str, optimizer_device: str) -> float:
    """GatheredParameters(modifier_rank=0) writes reach the shard files and the masters."""
    import accelerate_zero

    model = make_model()
    params = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}
    zero = {
        "stage": 3,
        "offload_param": params,
        "offload_optimizer": {"device": optimizer_device, "nvme_path": nvme_path},
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 64,
    }
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.0), config={"zero_optimization": zero}
    )
    with accelerate_zero.GatheredParameters([model.mid.weight], modifier_rank=0), torch.no_grad():
        if rank == 0:
            model.mid.weight.fill_(0.25)
    x = torch.randn(2, 7)
    engine.backward(engine(x).sum())
    engine.step()  # lr 0: the step writes the masters (now 0.25) back into the files
    assert engine.shard_store.shards, "the shards must be in files for this check"
    with accelerate_zero.GatheredParameters([model.mid.weight]):
        error = (model.mid.weight - 0.25).abs().max().item()
    engine.destroy()
    return error


def _run_all(rank: int, world_size: int, nvme_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: _train_case(rank, world_size, nvme_path, name) for name in CASES}
    if world_size == 2:
        for device in ("cpu", "nvme"):
            path = str(Path(nvme_path) / f"modify_{device}")
            out[f"modifier_error_{device}"] = _modify_through_gathered(rank, world_size, path, device)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_nvme_param_offload_matches_reference_with_shards_on_disk(tmp_path: Path, world_size: int) -> None:
    stale = tmp_path / "params_nvme_optimizer_cpu" / "accelerate_zero" / "params" / "rank00000" / "unit99999.bin"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left over by a killed job")
    for rank, result in enumerate(run_distributed(_run_all, world_size, str(tmp_path))):
        for name in CASES:
            r = result[name]
            assert r["diff"] < 1e-6, (name, rank, r["diff"])
            assert r["files_during"] and "unit99999.bin" not in r["files_during"], (name, r["files_during"])
            assert r["folder_gone"], name
            # host buffers (masters, kept shards) are cut from chunks at 3 ranks only; all-NVMe needs none
            assert r["chunked"] == (world_size == 3 and "optimizer cpu" in name), (name, r["chunked"])
            # never more than buffer_count swapped shards in memory; none of them between steps
            assert 0 < r["peak_resident"] <= BUFFERS, (name, r["peak_resident"])
            kept = r["all_numel"] - r["swapped_numel"]
            assert r["host_parameters"] == kept * r["element_size"], (name, r)
            assert r["nvme_bytes"] >= r["swapped_numel"] * r["element_size"]
        assert (
            result["params nvme, optimizer cpu"]["swapped_numel"] == result["params nvme, optimizer cpu"]["all_numel"]
        )
        partial = result["params nvme beyond max_in_cpu=120, optimizer cpu"]
        assert 0 < partial["all_numel"] - partial["swapped_numel"] <= 120
        if world_size == 2:
            assert result["modifier_error_cpu"] == result["modifier_error_nvme"] == 0.0


def _too_small_buffer(rank: int, world_size: int, nvme_path: str) -> str:
    import accelerate_zero

    model = make_model()
    params = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "buffer_size": 10}
    zero = {"stage": 3, "offload_param": params, "stage3_param_persistence_threshold": 0}
    try:
        accelerate_zero.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            config={"zero_optimization": zero},
        )
    except ValueError as error:
        return str(error)
    return ""


def test_nvme_param_buffer_size_must_hold_the_largest_shard(tmp_path: Path) -> None:
    (message,) = run_distributed(_too_small_buffer, 1, str(tmp_path))
    # mid.weight + mid.bias = 240 elements in one shard on one rank
    assert "zero_optimization.offload_param.buffer_size=10" in message and "at least 240" in message, message
