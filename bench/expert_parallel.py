"""Expert parallelism against flat stage 3 on one MoE model: bytes moved per step per collective kind, the experts'
share of them, peak memory per rank per phase and step time (issue 41, item 5).

Usage:
    .venv/bin/python bench/expert_parallel.py                                   # ~3 min on 2 busy cores
    .venv/bin/python bench/expert_parallel.py --runs flat3 ep2_s3 ep4_s3 --accums 1 --json bench/out/ep.json

Every run is a fresh group of W = 4 gloo processes (torch.multiprocessing, one thread each) training a
Qwen3MoeForCausalLM built from a config (`MODEL`: 4 layers, hidden 256, 16 experts of moe_intermediate 256, top-2,
vocabulary 2000, untied; the experts are ~86% of the parameters) in fp32 with AdamW, each rank a micro-batch of 2
sequences of 64 tokens, under the default stage 3 thresholds. One optimizer step (the warm-up: it records the
unit order and makes the optimizer states) then `--steps` measured ones, each of `accum` micro-steps.

Runs (`RUNS`): flat3 = stage 3 without expert parallelism, at the defaults (`stage3_max_reuse_distance` and
`stage3_max_live_parameters` 1e9, DeepSpeed's: a unit gathered in forward stays gathered until its backward, so
each expert is gathered once per micro-step); flat3_release = the same with `stage3_max_reuse_distance: 0` (each
unit released after its forward and gathered again in backward: twice per micro-step); ep2_s3 / ep4_s3 = stage 3 with
`expert_parallel: {enabled, autoep_size}` 2 / 4; ep4_s2 = stage 2 with ep 4.

Bytes are the engine's own count (`engine.comm_stats_counter`, engine/collectives.py: payload x (g - 1)/g for a
gather or reduce-scatter over g ranks; for an all-to-all the rows that leave the rank), per rank, for the last
measured step.
Which of them are the experts' ([Note: what the experts moved] below) is read from each collective as it is
recorded. Memory: VmHWM reset (`/proc/self/clear_refs`) at the start of each phase and read at its end (forward,
backward, the optimizer step), the largest over ranks and micro-steps; beside it `engine.memory_breakdown()` after
the last backward (the whole training state is held then). Times are the median over the measured steps, on
processes sharing 2 cores with other users: they say little.

[Note: what the experts moved]
- flat stage 3: the experts live in their decoder layer's gather unit. Each gather or reduce-scatter of a unit is
  counted as experts in the proportion of the unit's elements that are experts (at the default persistence
  threshold the attention and router weights are persistent, so a layer's unit is its experts alone).
- with expert parallelism what moves for the experts is the token all-to-alls (kinds all_to_all_experts,
  all_to_all_expert_routes and the counts' all_to_all), and over the expert peers (the W / ep ranks holding the
  same experts) the gradients' reduce-scatter and the experts' all-gather: at stage 3 with ep < W each layer's
  local experts are a gather unit over the peers, gathered in forward (and in backward when released between them),
  at ep = W they stay whole and the peers are one rank. The peers' collectives are told from the rest's by their
  group size: W / ep ranks (2 here at ep 2; at ep 4 = W nothing moves), while the rest's run over all W.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

WORLD, MICRO, SEQ = 4, 2, 64
MODEL = dict(
    vocab_size=2000, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
RELEASE = {"stage3_max_reuse_distance": 0}
RUNS = {
    "flat3": (3, 1, {}),
    "flat3_release": (3, 1, RELEASE),
    "ep2_s3": (3, 2, {}),
    "ep4_s3": (3, 4, {}),
    "ep4_s2": (2, 4, {}),
}
"""name -> (ZeRO stage, expert-parallel size (1: off), other zero_optimization keys)."""
MB = 1e6


# ------------------------------------------------------------------------------------------------- one rank
def _model() -> Any:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL)).float()


def _config(stage: int, ep: int, zero: dict[str, Any], accum: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **zero},
    }
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return config


class _Recorder:
    """Every collective the engine records, with its kind, payload and ring factor (the group size shows in it)."""

    def __init__(self, stats: Any) -> None:
        self.calls: list[tuple[str, int, float]] = []
        original = stats.record

        def record(kind: str, payload: int, ring: float, between: float = 0.0) -> None:
            self.calls.append((kind, payload, ring))
            original(kind, payload, ring, between)

        stats.record = record  # this instance only: every component holds this same CommStats object


def _unit_fractions(engine: Any, expert_numel: dict[int, int]) -> dict[int, float]:
    """Flat stage 3: a unit's padded elements -> the share of them that are experts ([Note: what the experts
    moved]); units of the same size have the same make-up here (identical decoder layers)."""
    out: dict[int, float] = {}
    scheduler = getattr(engine, "scheduler", None)
    for unit in scheduler.units if scheduler is not None else []:
        params = unit.trainable.params if unit.trainable is not None else []
        experts = sum(expert_numel.get(id(p), 0) for p in params)
        out[unit.numel] = experts / unit.numel if unit.numel else 0.0
        if unit.bucket is not None:
            out[unit.bucket.plan.numel] = out[unit.numel]
    return out


def _split_bytes(calls: list[tuple[str, int, float]], ep: int, fractions: dict[int, float]) -> dict[str, float]:
    """Bytes per rank of the experts by what moved them, and of the rest ([Note: what the experts moved])."""
    world_ring = (WORLD - 1) / WORLD
    out = dict.fromkeys(("expert_gathers", "expert_reduce_scatters", "expert_all_to_all", "rest"), 0.0)
    for kind, payload, ring in calls:
        moved = payload * ring
        if kind.startswith("all_to_all"):
            out["expert_all_to_all" if ep > 1 else "rest"] += moved
        elif kind in ("all_gather", "reduce_scatter"):
            key = "expert_gathers" if kind == "all_gather" else "expert_reduce_scatters"
            if ep > 1:
                out[key if abs(ring - world_ring) > 1e-9 else "rest"] += moved
            else:
                share = fractions.get(payload // 4, 0.0)  # fp32 payloads
                out[key] += moved * share
                out["rest"] += moved * (1 - share)
        else:
            out["rest"] += moved
    out["expert_total"] = out["expert_gathers"] + out["expert_reduce_scatters"] + out["expert_all_to_all"]
    return out


def _rank(rank: int, name: str, accum: int, steps: int, seq: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from harness.readings import proc_status, reset_peak_rss

    import accelerate_zero
    from accelerate_zero.engine.experts.blocks import find_expert_layers

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    stage, ep, zero = RUNS[name]
    model = _model()
    expert_numel = {id(p): p.numel() for layer in find_expert_layers(model) for p in layer.params()}
    counts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "expert_parameters": sum(expert_numel.values()),
    }
    before_init = proc_status()["VmRSS"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = accelerate_zero.initialize(model, optimizer, config=_config(stage, ep, zero, accum))
    fractions = _unit_fractions(engine, expert_numel) if ep == 1 else {}
    generator = torch.Generator().manual_seed(rank)
    peaks = dict.fromkeys(("forward", "backward", "step"), 0)
    times, recorder, breakdown = [], None, {}
    for step in range(steps + 1):
        if step == steps:  # the last step's collectives are the ones reported
            engine.reset_comm_stats()
            recorder = _Recorder(engine.comm_stats_counter)
        dist.barrier()
        start = time.perf_counter()
        for micro in range(accum):
            tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, seq), generator=generator)
            reset_peak_rss()
            loss = engine(input_ids=tokens, labels=tokens).loss
            forward_peak = proc_status()["VmHWM"]
            reset_peak_rss()
            engine.backward(loss)
            backward_peak = proc_status()["VmHWM"]
            if micro == accum - 1:
                breakdown = engine.memory_breakdown()
                reset_peak_rss()
            engine.step()
            step_peak = proc_status()["VmHWM"]
            if step > 0:  # the warm-up's first forward records the unit order and the step makes the states
                peaks["forward"] = max(peaks["forward"], forward_peak)
                peaks["backward"] = max(peaks["backward"], backward_peak)
                if micro == accum - 1:
                    peaks["step"] = max(peaks["step"], step_peak)
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - start)
    assert recorder is not None
    result = {
        "kinds": engine.comm_stats(),
        "experts": _split_bytes(recorder.calls, ep, fractions),
        "peaks": peaks,
        "rss_before_initialize": before_init,
        "breakdown": breakdown,
        "step_seconds": statistics.median(times),
        "counts": counts,
    }
    engine.destroy()
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


# -------------------------------------------------------------------------------------------------- driver
def run(name: str, accum: int, steps: int, seq: int, port: int) -> list[dict[str, Any]]:
    """Every rank's readings of one run (a fresh process group)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(name, accum, steps, seq, port, out_dir), nprocs=WORLD)
        return [json.loads(Path(out_dir, f"{rank}.json").read_text()) for rank in range(WORLD)]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes per rank (rank 0's; every rank moves the same, up to the all-to-alls' uneven counts: the largest),
    peaks and breakdown (largest over ranks), step time (largest median over ranks)."""
    kinds = {k: max(r["kinds"][k]["bytes_per_rank"] for r in ranks) for k in ranks[0]["kinds"] if k != "total"}
    experts = {k: max(r["experts"][k] for r in ranks) for k in ranks[0]["experts"]}
    return {
        "kinds": kinds,
        "experts": experts,
        "peaks": {k: max(r["peaks"][k] for r in ranks) for k in ranks[0]["peaks"]},
        "rss_before_initialize": max(r["rss_before_initialize"] for r in ranks),
        "breakdown": {k: max(r["breakdown"][k] for r in ranks) for k in ranks[0]["breakdown"]},
        "step_seconds": max(r["step_seconds"] for r in ranks),
        "counts": ranks[0]["counts"],
    }


def _bytes_table(results: dict[str, dict[str, Any]]) -> str:
    kinds = sorted({k for r in results.values() for k in r["kinds"]})
    head = "| run | " + " | ".join(kinds) + " | experts: gathers | reduce-scatters | all-to-alls | experts total |"
    lines = [head, "|" + "---|" * (len(kinds) + 5)]
    for key, r in results.items():
        cells = [f"{r['kinds'].get(k, 0) / MB:.2f}" for k in kinds]
        e = r["experts"]
        cells += [f"{e[k] / MB:.2f}" for k in ("expert_gathers", "expert_reduce_scatters", "expert_all_to_all")]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | **{e['expert_total'] / MB:.2f}** |")
    return "\n".join(lines)


def _memory_table(results: dict[str, dict[str, Any]]) -> str:
    kinds = ("parameters", "gradients", "optimizer_states", "communication_buffers", "total")
    lines = [
        "| run | RSS before initialize | peak forward | peak backward | peak step | "
        + " | ".join(f"held {k}" for k in kinds)
        + " | step s |",
        "|" + "---|" * (len(kinds) + 6),
    ]
    for key, r in results.items():
        p, b = r["peaks"], r["breakdown"]
        cells = [f"{r['rss_before_initialize'] / MB:.1f}"] + [
            f"{p[k] / MB:.1f}" for k in ("forward", "backward", "step")
        ]
        cells += [f"{b.get(k, 0) / MB:.2f}" for k in kinds]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {r['step_seconds']:.3f} |")
    return "\n".join(lines)


HELD = ("parameters", "gradients", "master_weights", "optimizer_states")


def held_rows(results: dict[str, dict[str, Any]], accums: list[int]) -> list[str]:
    """Issue 52 item 3: at stage 3 the model state held per rank with expert parallelism is flat stage 3's ([Note:
    experts below 1/ep at stage 3] in engine/experts/gather_units.py), read from `engine.memory_breakdown()`."""
    out = []
    for accum, name in itertools.product(accums, ("ep2_s3", "ep4_s3")):
        flat, got = results.get(f"flat3 accum {accum}"), results.get(f"{name} accum {accum}")
        if flat is None or got is None:
            continue
        mine, theirs = (sum(r["breakdown"].get(k, 0) for k in HELD) for r in (got, flat))
        params = got["breakdown"]["parameters"], flat["breakdown"]["parameters"]
        out.append(
            f"held state: {name} accum {accum} {mine / MB:.2f} MB vs flat3's {theirs / MB:.2f} MB "
            f"(ratio {mine / theirs:.4f}; parameters {params[0] / MB:.2f} vs {params[1] / MB:.2f} MB)"
        )
    return out


def checks(results: dict[str, dict[str, Any]], accums: list[int]) -> list[str]:
    """The issue's goal: with expert parallelism at most 1/ep of flat stage 3's expert bytes per step."""
    out = []
    for accum in accums:
        for flat_name, name in itertools.product(("flat3", "flat3_release"), ("ep2_s3", "ep4_s3")):
            flat, got = results.get(f"{flat_name} accum {accum}"), results.get(f"{name} accum {accum}")
            if flat is None or got is None:
                continue
            ep = RUNS[name][1]
            mine, theirs = got["experts"]["expert_total"], flat["experts"]["expert_total"]
            gathers = got["experts"]["expert_gathers"], flat["experts"]["expert_gathers"]
            passed = mine <= theirs / ep
            out.append(
                f"{'PASS' if passed else 'FAIL'}: {name} accum {accum} vs {flat_name}: expert bytes {mine / MB:.2f} MB "
                f"{'<=' if passed else '>'} flat's {theirs / MB:.2f} MB / "
                f"{ep} = {theirs / ep / MB:.2f} MB (ratio {mine / theirs:.4f}); expert parameter gathers "
                f"{gathers[0] / MB:.2f} MB vs flat's {gathers[1] / MB:.2f} MB"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--accums", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps after the warm-up")
    parser.add_argument("--seq", type=int, default=SEQ, help=f"tokens per sequence (default {SEQ})")
    parser.add_argument("--port", type=int, default=29671)
    parser.add_argument("--json", default=None, help="write every rank's readings here")
    args = parser.parse_args()
    raw, results = {}, {}
    for i, (accum, name) in enumerate((a, n) for a in args.accums for n in args.runs):
        key = f"{name} accum {accum}"
        raw[key] = run(name, accum, args.steps, args.seq, args.port + i)
        results[key] = summarize(raw[key])
    counts = next(iter(results.values()))["counts"]
    print(
        f"Qwen3-MoE {counts['parameters'] / 1e6:.2f}M parameters, experts {counts['expert_parameters'] / 1e6:.2f}M "
        f"({4 * counts['expert_parameters'] / MB:.1f} MB fp32), W = {WORLD}, {MICRO} x {args.seq} tokens per rank "
        "and micro-step\n"
    )
    print("Bytes per rank in one optimizer step (MB), per collective kind and the experts' share:\n")
    print(_bytes_table(results) + "\n")
    print("Memory per rank (MB): VmHWM per phase, engine.memory_breakdown() after the last backward:\n")
    print(_memory_table(results) + "\n")
    print("\n".join(checks(results, args.accums) + held_rows(results, args.accums)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": raw, "summary": results}, indent=1))


if __name__ == "__main__":
    main()
