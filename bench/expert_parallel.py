"""Expert parallelism against flat stage 3 on one MoE model: bytes moved per step per collective kind, the experts'
share of them, peak memory per rank per phase and step time (issue 41, item 5; bench/README.md, "expert_parallel.py").

Usage:
    .venv/bin/python bench/expert_parallel.py                                   # ~3 min on 2 busy cores
    .venv/bin/python bench/expert_parallel.py --runs flat3 ep2_s3 ep4_s3 --accums 1 --json bench/out/ep.json

[Note: what the experts moved]
- flat stage 3: the experts live in their decoder layer's gather unit. Each gather or reduce-scatter of a unit is
  counted as experts in the proportion of the unit's elements that are experts (at the default persistence
  threshold the attention and router weights are persistent, so a layer's unit is its experts alone).
- with expert parallelism the experts never join a unit: what moves for them is the token all-to-alls
  (kinds all_to_all_experts, all_to_all_expert_routes and the counts' all_to_all), and over the expert peers (the
  W / ep ranks holding the same experts) the gradients' reduce-scatter and the updated experts' all-gather after
  the step. The peers' collectives are told from the rest's by their group size: W / ep ranks (2 here at ep 2; at
  ep 4 = W the peers are one rank and nothing moves), while the rest's run over all W.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from harness import launch, report


WORLD, MICRO, SEQ = 4, 2, 64
MODEL = dict(
    vocab_size=2000, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
RUNS = {
    "flat3": (3, 1, {}),
    "flat3_release": (3, 1, {"stage3_max_reuse_distance": 0}),
    "ep2_s3": (3, 2, {}),
    "ep4_s3": (3, 4, {}),
    "ep4_s2": (2, 4, {}),
}
"""name -> (ZeRO stage, expert-parallel size (1: off), other zero_optimization keys)."""
MB = 1e6
PHASES = ("forward", "backward", "step")


# ------------------------------------------------------------------------------------------------- one rank
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


def train(name: str, accum: int, steps: int, seq: int) -> dict[str, Any]:
    """Rank function: one warm-up step (it records the unit order and makes the optimizer states), then `steps`
    measured ones of `accum` micro-steps; the last step's bytes, the phases' peaks, the breakdown, the time."""
    import torch
    import torch.distributed as dist
    from harness.readings import proc_status, reset_peak_rss
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import accelerate_zero
    from accelerate_zero.engine.experts.blocks import find_expert_layers

    stage, ep, zero = RUNS[name]
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL)).float()
    expert_numel = {id(p): p.numel() for layer in find_expert_layers(model) for p in layer.params()}
    counts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "expert_parameters": sum(expert_numel.values()),
    }
    before_init = proc_status()["VmRSS"]
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
                              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, **zero}}  # fmt: skip
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    fractions = _unit_fractions(engine, expert_numel) if ep == 1 else {}
    generator = torch.Generator().manual_seed(dist.get_rank())
    peaks = dict.fromkeys(PHASES, 0)
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
            forward = proc_status()["VmHWM"]
            reset_peak_rss()
            engine.backward(loss)
            backward, boundary = proc_status()["VmHWM"], micro == accum - 1
            breakdown = engine.memory_breakdown() if boundary else breakdown
            reset_peak_rss()
            engine.step()
            optimizer = proc_status()["VmHWM"]
            if step > 0:  # the warm-up's first forward records the unit order and the step makes the states
                peaks["forward"], peaks["backward"] = max(peaks["forward"], forward), max(peaks["backward"], backward)
                peaks["step"] = max(peaks["step"], optimizer) if boundary else peaks["step"]
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - start)
    result = {"kinds": engine.comm_stats(), "experts": _split_bytes(recorder.calls, ep, fractions), "peaks": peaks,
              "rss_before_initialize": before_init, "breakdown": breakdown, "step_seconds": statistics.median(times),
              "counts": counts}  # fmt: skip
    engine.destroy()
    return result


# -------------------------------------------------------------------------------------------------- driver
def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes per rank (every rank moves the same, up to the all-to-alls' uneven counts: the largest), peaks and
    breakdown (largest over ranks), step time (largest median over ranks)."""
    largest = lambda key: {k: max(r[key][k] for r in ranks) for k in ranks[0][key]}  # noqa: E731
    kinds = {k: max(r["kinds"][k]["bytes_per_rank"] for r in ranks) for k in ranks[0]["kinds"] if k != "total"}
    return {"kinds": kinds, "experts": largest("experts"), "peaks": largest("peaks"),
            "breakdown": largest("breakdown"), "rss_before_initialize": max(r["rss_before_initialize"] for r in ranks),
            "step_seconds": max(r["step_seconds"] for r in ranks), "counts": ranks[0]["counts"]}  # fmt: skip


def _tables(results: dict[str, dict[str, Any]]) -> str:
    kinds = sorted({k for r in results.values() for k in r["kinds"]})
    expert_kinds = ("expert_gathers", "expert_reduce_scatters", "expert_all_to_all")
    rows = [(key, *(f"{r['kinds'].get(k, 0) / MB:.2f}" for k in kinds),
             *(f"{r['experts'][k] / MB:.2f}" for k in expert_kinds), f"**{r['experts']['expert_total'] / MB:.2f}**")
            for key, r in results.items()]  # fmt: skip
    columns = ["run", *kinds, "experts: gathers", "reduce-scatters", "all-to-alls", "experts total"]
    held = ("parameters", "gradients", "optimizer_states", "communication_buffers", "total")
    memory = [(key, f"{r['rss_before_initialize'] / MB:.1f}", *(f"{r['peaks'][k] / MB:.1f}" for k in PHASES),
               *(f"{r['breakdown'].get(k, 0) / MB:.2f}" for k in held), f"{r['step_seconds']:.3f}")
              for key, r in results.items()]  # fmt: skip
    memory_columns = ["run", "RSS before initialize", "peak forward", "peak backward", "peak step",
                      *(f"held {k}" for k in held), "step s"]  # fmt: skip
    return (
        "Bytes per rank in one optimizer step (MB), per collective kind and the experts' share:\n\n"
        + report.table(columns, rows)
        + "\n\nMemory per rank (MB): VmHWM per phase, engine.memory_breakdown() after the last backward:\n\n"
        + report.table(memory_columns, memory)
    )


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
                f"{'PASS' if passed else 'FAIL'}: {name} accum {accum} vs {flat_name}: expert bytes {mine / MB:.2f} "
                f"MB {'<=' if passed else '>'} flat's {theirs / MB:.2f} MB / {ep} = {theirs / ep / MB:.2f} MB (ratio "
                f"{mine / theirs:.4f}); expert parameter gathers {gathers[0] / MB:.2f} MB vs flat's "
                f"{gathers[1] / MB:.2f} MB"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--accums", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps after the warm-up")
    parser.add_argument("--seq", type=int, default=SEQ, help=f"tokens per sequence (default {SEQ})")
    parser.add_argument("--json", type=Path, default=None, help="write every rank's readings here")
    args = parser.parse_args()
    facts, raw, results = report.machine_facts(), {}, {}
    for accum, name in itertools.product(args.accums, args.runs):
        key = f"{name} accum {accum}"
        kwargs = {"name": name, "accum": accum, "steps": args.steps, "seq": args.seq}
        raw[key] = launch.on_ranks(WORLD, train, kwargs, name=f"{name}_accum{accum}").results
        results[key] = summarize(raw[key])
    counts = next(iter(results.values()))["counts"]
    print(report.header(facts, "expert_parallel: expert parallelism against flat stage 3"))
    print(f"Qwen3-MoE {counts['parameters'] / 1e6:.2f}M parameters, experts {counts['expert_parameters'] / 1e6:.2f}M "
          f"({4 * counts['expert_parameters'] / MB:.1f} MB fp32), W = {WORLD}, {MICRO} x {args.seq} tokens per rank "
          "and micro-step\n")  # fmt: skip
    print(_tables(results) + "\n\n" + "\n".join(checks(results, args.accums)))
    if args.json:
        report.save_json(args.json, {"runs": raw, "summary": results}, facts)


if __name__ == "__main__":
    main()
