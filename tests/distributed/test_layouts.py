"""Hierarchical layouts (hpZ, MiCS / replicate x shard) on 2 simulated nodes of 2 and 4 gloo ranks.

One spawned group per world size trains a tiny Llama (tied embeddings) under flat stage 3, hpZ and MiCS with
gradient accumulation and clipping, and checks:
- each layout against one process on the full batch (fp32), and against flat stage 3 (<= 1e-6);
- the bytes that crossed nodes per step, summed over ranks, against the formulas of bench/README.md ("Bytes
  between nodes"): flat (2P + G)(k - 1), hpZ (P + G)(k - 1), MiCS 2G(k - 1) per micro-step, with P the gathered
  bytes of every unit, G the reduced gradient bytes and k nodes;
- that hpZ's and MiCS's backward all-gathers cross no node boundary;
- a checkpoint saved under MiCS resumed flat, and one saved flat resumed under hpZ and MiCS, equal to the run
  that never stopped;
- ZeRO++ (hpZ + qwZ + qgZ): the quantized collectives within their stated error bounds against exact sums, the
  bytes between nodes equal to the formula with int8 weights and int4 gradients, at least 4x below flat stage 3,
  and the losses of every micro-step within 1% of flat stage 3's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from accelerate_zero.debug.layouts import layout_rows
from tests.helpers.dist import run_distributed
from tests.helpers.models import tiny_llama_config


STEPS, GRAD_ACCUM, SEQ, VOCAB, NODES = 3, 2, 10, 64, 2
CLIP = 0.5  # acts on every step (the norms are ~0.95): a norm summed over the wrong group changes the result
BASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
PARAM_KINDS = ("all_gather", "all_gather_int8", "all_gather_scales")
GRAD_KINDS = (
    "reduce_scatter",
    "all_reduce_replicas",
    "all_to_all_int4_node",
    "all_to_all_scales_node",
    "all_to_all_int4_across",
    "all_to_all_scales_across",
)
WEIGHT_BLOCK, GRADIENT_BLOCK = 256, 64  # engine/quantized_comm.py WEIGHTS and GRADIENTS
LOSS_BOUND = 0.01


def _layouts(per_node: int) -> dict[str, dict]:
    return {
        "flat": {},
        "hpz": {"zero_hpz_partition_size": per_node},
        "mics": {"mics_shard_size": per_node},
    }


def _model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _zeropp(per_node: int) -> dict:
    return {"zero_hpz_partition_size": per_node, "zero_quantized_weights": True, "zero_quantized_gradients": True}


def _batches(world_size: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        [torch.randint(0, VOCAB, (world_size, SEQ), generator=gen) for _ in range(GRAD_ACCUM)] for _ in range(STEPS)
    ]


def _reference(batches: list[list[torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The weights after training on one process, and the gradient norm of every step (before clipping)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in batches:
        for tokens in step:
            (model(input_ids=tokens, labels=tokens).loss / GRAD_ACCUM).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _engine(extra: dict) -> Any:
    import accelerate_zero

    model = _model()
    config = {
        "gradient_accumulation_steps": GRAD_ACCUM,
        "gradient_clipping": CLIP,
        "zero_optimization": {**BASE, **extra},
    }
    return accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config=config)


def _between(stats: dict, kinds: tuple[str, ...]) -> float:
    return sum(stats[k]["between_nodes_bytes"] for k in kinds if k in stats)


def _train(engine: Any, batches: list, rank: int, steps: range) -> list[dict[str, float]]:
    """Trains `steps`; returns per step this rank's bytes between nodes: forward and backward gathers, gradients."""
    record = []
    for index in steps:
        sums: dict[str, Any] = {"forward": 0.0, "backward": 0.0, "grads": 0.0, "backward_gathers": 0, "losses": []}
        for tokens in batches[index]:
            mine = tokens[rank : rank + 1]
            engine.reset_comm_stats()
            loss = engine(input_ids=mine, labels=mine).loss
            sums["losses"].append(loss.item())
            sums["forward"] += _between(engine.comm_stats(), PARAM_KINDS)
            engine.reset_comm_stats()
            engine.backward(loss)
            stats = engine.comm_stats()
            sums["backward"] += _between(stats, PARAM_KINDS)
            sums["backward_gathers"] += stats.get("all_gather", {}).get("calls", 0)
            sums["grads"] += _between(stats, GRAD_KINDS)
            engine.step()
        sums["norm"] = engine.get_global_grad_norm()
        record.append(sums)
    return record


def _params(engine: Any) -> dict[str, torch.Tensor]:
    import accelerate_zero

    with accelerate_zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _sizes(engine: Any) -> dict[str, int]:
    """P and G of the formulas: the bytes of every gathered unit and of every reduced gradient bucket (padded);
    P8 and G4 the same quantized: int8 (int4) codes of each rank's shard padded to whole blocks of 256 (64), and 4
    bytes of scale per block."""
    world = engine.layout.world.world_size

    def blocks(numel: int, block: int) -> int:
        return -(-numel // block)

    flats = [flat.plan for unit in engine.units for flat in unit.flats]
    buckets = [bucket.plan for bucket in engine.reducer.buckets]
    return {
        "P": sum(plan.numel * 4 for plan in flats),
        "G": sum(plan.numel * 4 for plan in buckets),
        "P8": sum(world * blocks(plan.shard_numel, WEIGHT_BLOCK) * (WEIGHT_BLOCK + 4) for plan in flats),
        "G4": sum(world * blocks(plan.shard_numel, GRADIENT_BLOCK) * (GRADIENT_BLOCK // 2 + 4) for plan in buckets),
    }


def _all_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    os.environ["ACCELERATE_ZERO_SIMULATED_NODES"] = str(NODES)
    per_node = world_size // NODES
    batches = _batches(world_size)
    reference, norms = _reference(batches)
    out: dict[str, Any] = {"runs": {}}
    finals = {}
    for name, extra in _layouts(per_node).items():
        engine = _engine(extra)
        steps = _train(engine, batches, rank, range(STEPS))
        finals[name] = _params(engine)
        out["runs"][name] = {
            "steps": steps,
            "sizes": _sizes(engine),
            "vs_reference": _diff(finals[name], reference),
            # the clip acts on every step, so a gradient scaled wrongly shows in the norm, not in the weights
            "norm_error": max(abs(s["norm"] - n) / n for s, n in zip(steps, norms, strict=True)),
            "kind": engine.layout.plan.kind,
            "held": engine.memory_breakdown()["parameters"] if rank == 0 else None,
        }
    out["vs_flat"] = {name: _diff(finals[name], finals["flat"]) for name in finals}
    engine = _engine(_zeropp(per_node))
    out["zeropp"] = {"steps": _train(engine, batches, rank, range(STEPS)), "sizes": _sizes(engine)}
    out["zeropp"]["vs_reference"] = _diff(_params(engine), reference)
    out["quantized"] = _quantized_collectives(rank, world_size, per_node)
    out["loaded"] = _partitioned_loading(rank, per_node, batches, finals["flat"], folder)
    out["accelerate"] = _through_parallelism_config(rank, per_node, batches, finals["flat"])
    out["resume"] = _resumes(rank, batches, per_node, finals["flat"], folder)
    return out


def _quantized_collectives(rank: int, world_size: int, per_node: int) -> dict[str, float]:
    """Both quantized collectives against exact sums: the worst error as a fraction of its bound."""
    from accelerate_zero.engine.collectives import CommStats
    from accelerate_zero.engine.groups import init_data_parallel_group
    from accelerate_zero.engine.layout import LayoutPlan, build_sharding_layout
    from accelerate_zero.engine.nodes import NodeLayout
    from accelerate_zero.engine.quantized_comm import (
        BlockQuantization,
        error_bound,
        quantized_all_gather,
        quantized_reduce_scatter,
        two_level_error_bound,
    )

    world = init_data_parallel_group(torch.device("cpu"))
    layout = build_sharding_layout(world, LayoutPlan(NodeLayout(world_size, per_node), world_size, two_level=True))
    chunk = 300  # not a whole number of blocks
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(world_size * chunk, generator=gen) * 10.0 ** (r - 2) for r in range(world_size)]
    q4, q8 = BlockQuantization(4, 64), BlockQuantization(8, 64)
    out = torch.empty(chunk)
    quantized_reduce_scatter(out, inputs[rank].clone(), layout.two_level, CommStats(), q4)
    exact = sum(x.double() for x in inputs).view(world_size, chunk)[rank]
    bound = two_level_error_bound(inputs, per_node, q4, owner=rank).double()
    shards = [x[:chunk] for x in inputs]
    gathered = torch.empty(world_size * chunk)
    quantized_all_gather(gathered, shards[rank].clone(), world, CommStats(), q8).wait()
    gather_bound = torch.cat([error_bound(x, q8) for x in shards]).double()
    return {
        "reduce_scatter": ((out.double() - exact).abs() / (bound + 1e-6)).max().item(),
        "all_gather": ((gathered.double() - torch.cat(shards).double()).abs() / (gather_bound + 1e-9)).max().item(),
        "reduce_scatter_error": (out.double() - exact).abs().max().item(),
    }


def _partitioned_loading(rank: int, per_node: int, batches: list, expected: dict, folder: str) -> float:
    """`accelerate_zero.from_pretrained` under MiCS: each rank reads its group's shard; trains like flat."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import accelerate_zero

    if rank == 0:
        _model().save_pretrained(f"{folder}/model")
    dist.barrier()
    zero = {**BASE, "mics_shard_size": per_node}
    model = accelerate_zero.from_pretrained(LlamaForCausalLM, f"{folder}/model", config={"zero_optimization": zero})
    config = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": CLIP, "zero_optimization": zero}
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config=config
    )
    _train(engine, batches, rank, range(STEPS))
    return _diff(_params(engine), expected)


def _through_parallelism_config(rank: int, per_node: int, batches: list, expected: dict) -> dict[str, Any]:
    """accelerate's ParallelismConfig(dp_replicate_size, dp_shard_size) through ZeroAccelerator: replicate x shard,
    trained like flat stage 3."""
    from accelerate import ParallelismConfig

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    zero = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": CLIP, "zero_optimization": BASE}
    accelerator = ZeroAccelerator(
        zero_plugin=ZeroPlugin(config=zero),
        parallelism_config=ParallelismConfig(dp_replicate_size=NODES, dp_shard_size=per_node),
        gradient_accumulation_steps=GRAD_ACCUM,
        cpu=True,  # the process group exists already (the engines above made it)
    )
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    engine = accelerator.zero_engines[0]
    for step in batches:
        for tokens in step:
            with accelerator.accumulate(model):
                mine = tokens[rank : rank + 1]
                accelerator.backward(model(input_ids=mine, labels=mine).loss)
                optimizer.step()
                optimizer.zero_grad()
    return {
        "kind": engine.layout.plan.kind,
        "shard": engine.dp.world_size,
        "vs_flat": _diff(_params(engine), expected),
    }


def _resumes(rank: int, batches: list, per_node: int, expected: dict, folder: str) -> dict[str, float]:
    """Two steps under one layout, saved; the last step under another after loading: equal to the flat run."""
    layouts = _layouts(per_node)
    out = {}
    for saved, loaded in (("mics", "flat"), ("flat", "hpz"), ("flat", "mics")):
        first = _engine(layouts[saved])
        _train(first, batches, rank, range(STEPS - 1))
        first.save_checkpoint(f"{folder}/{saved}-{loaded}", tag="t")
        second = _engine(layouts[loaded])
        second.load_checkpoint(f"{folder}/{saved}-{loaded}", tag="t")
        _train(second, batches, rank, range(STEPS - 1, STEPS))
        out[f"{saved}->{loaded}"] = _diff(_params(second), expected)
    return out


def _expected_between_nodes(name: str, sizes: dict[str, int]) -> dict[str, float]:
    """Per step, summed over every rank ([Note: bytes between nodes] in engine/collectives.py)."""
    crossings = (NODES - 1) * GRAD_ACCUM
    P, G = sizes["P"], sizes["G"]
    if name == "zeropp":  # hpZ's layout, int8 codes for the forward gathers, int4 across nodes for gradients
        return {"forward": crossings * sizes["P8"], "backward": 0, "grads": crossings * sizes["G4"]}
    return {
        "forward": crossings * (P if name in ("flat", "hpz") else 0),
        "backward": crossings * (P if name == "flat" else 0),
        "grads": crossings * (2 * G if name == "mics" else G),
    }


def _check_between_nodes(results: list, name: str, run_of: Any) -> None:
    first = run_of(results[0])
    expected = _expected_between_nodes(name, first["sizes"])
    for step in range(STEPS):
        measured = {part: sum(run_of(result)["steps"][step][part] for result in results) for part in expected}
        for part, value in expected.items():
            assert measured[part] == pytest.approx(value, rel=1e-9, abs=1e-6), (name, step, part, measured)
        if name != "flat":
            assert all(run_of(r)["steps"][step]["backward_gathers"] > 0 for r in results), name


def _total_between_nodes(results: list, run_of: Any) -> float:
    return sum(run_of(r)["steps"][0][p] for r in results for p in ("forward", "backward", "grads"))


@pytest.mark.parametrize("world_size", [4, 8])
def test_hierarchical_layouts_on_two_nodes(world_size: int, tmp_path) -> None:
    results = run_distributed(_all_checks, world_size, str(tmp_path), timeout=600)
    first = results[0]
    assert {name: run["kind"] for name, run in first["runs"].items()} == {
        "flat": "flat",
        "hpz": "hpz",
        "mics": "replicate_x_shard",
    }
    for name in first["runs"]:
        assert first["runs"][name]["vs_reference"] < 1e-5, (name, first["runs"][name]["vs_reference"])
        assert first["runs"][name]["norm_error"] < 1e-5, (name, first["runs"][name]["norm_error"])
        assert first["vs_flat"][name] <= 1e-6, (name, first["vs_flat"][name])
        _check_between_nodes(results, name, lambda result, name=name: result["runs"][name])
    # hpZ and MiCS cut what crosses nodes: hpZ by P, MiCS by 2P - G per micro-step.
    totals = {name: _total_between_nodes(results, lambda r, name=name: r["runs"][name]) for name in first["runs"]}
    assert totals["hpz"] < totals["flat"] and totals["mics"] < totals["flat"], totals
    # The estimator's formulas (debug/layouts.py, per node and micro-step) give the same bytes.
    per_node = world_size // NODES
    for name, row_name in (("flat", "flat"), ("hpz", "hpZ"), ("mics", "MiCS")):
        sizes = first["runs"][name]["sizes"]
        rows = {row.name: row for row in layout_rows(sizes["P"] // 4, sizes["G"] // 4, 4, 4, NODES, per_node, 0)}
        assert totals[name] == pytest.approx(rows[row_name].traffic.between * NODES * GRAD_ACCUM, rel=1e-9), name
    # ZeRO++: the formula, at least 4x below flat stage 3, the losses close to flat's, the collectives in bounds.
    _check_between_nodes(results, "zeropp", lambda r: r["zeropp"])
    assert totals["flat"] / _total_between_nodes(results, lambda r: r["zeropp"]) >= 4.0
    for step in range(STEPS):
        flat_losses = first["runs"]["flat"]["steps"][step]["losses"]
        for ours, flat in zip(first["zeropp"]["steps"][step]["losses"], flat_losses, strict=True):
            assert abs(ours - flat) <= LOSS_BOUND * flat, (step, ours, flat)
    for result in results:
        assert result["quantized"]["reduce_scatter"] <= 1.0 and result["quantized"]["all_gather"] <= 1.0
    # MiCS holds 1/(ranks per node) of the parameters per rank, flat 1/W.
    assert first["runs"]["mics"]["held"] > first["runs"]["flat"]["held"] * (NODES - 0.5)
    assert first["accelerate"]["kind"] == "replicate_x_shard" and first["accelerate"]["shard"] == world_size // NODES
    assert first["accelerate"]["vs_flat"] <= 1e-6, first["accelerate"]
    assert first["loaded"] <= 1e-6, first["loaded"]
    for case, diff in first["resume"].items():
        assert diff <= 1e-6, (case, diff)


def _backward_gathers_untied(rank: int, world_size: int) -> dict[str, int]:
    """Gathers per backward with an untied LM head, whose final norm (in the root unit) finishes its gradients
    early: each unit once, none fetched again after its backward is over."""
    import accelerate_zero

    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False))
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": BASE}
    )
    tokens = torch.randint(0, VOCAB, (1, SEQ))
    for _ in range(2):  # the second step follows the recorded trace (prefetching)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.reset_comm_stats()
        engine.backward(loss)
        engine.step()
    return {"gathers": engine.comm_stats()["all_gather"]["calls"], "units": sum(1 for u in engine.units if u.numel)}


def test_backward_gathers_each_unit_once() -> None:
    for result in run_distributed(_backward_gathers_untied, 2):
        assert result["gathers"] == result["units"], result
