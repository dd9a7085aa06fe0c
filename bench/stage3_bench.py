"""ZeRO stage 3 of accelerate_zero against DDP, stage 2, PyTorch FSDP2 and DeepSpeed stage 3; and partitioned loading.

Usage:
    .venv/bin/python bench/stage3_bench.py                                  # W = 4 then 2, loading at W = 2
    .venv/bin/python bench/stage3_bench.py --world_sizes 4 --no_load --json bench/out/s3_w4.json
    .venv/bin/python bench/stage3_bench.py --world_sizes 2 --systems ddp fsdp2 az3 --no_load
    .venv/bin/python bench/stage3_bench.py --world_sizes --load_only        # only the loading measurement
    .venv/bin/python bench/stage3_bench.py --world_sizes 4 --no_load --systems ddp fsdp2 az2 az3 \
        --grad_accums 1 4 --steps 3 --warmup 1                                   # peak memory under accumulation
    .venv/bin/python bench/stage3_bench.py --world_sizes 4 --no_load --systems az3 --grad_accums 1 4 \
        --steps 3 --warmup 1 --arena_whole                     # the same, gradient arenas counted as a GPU does

Each system trains the Linear stack in its own group (`steps.train`; stage 3 under `models.STAGE3_KEYS`, each Linear a
gather unit); `--grad_accums` adds the peak under accumulation; loading saves a ~29M Llama once and loads it
partitioned (`accelerate_zero.from_pretrained`) and whole (transformers). bench/README.md, "stage3_bench.py", says
what each column and check reads.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import launch, models, report, steps
from harness.peers import FORMULA_TEXT, PEERS
from harness.report import Check, fmt, ratio
from harness.summary import MB, Summary, comm_formula_bytes, summarize


SYSTEMS = ["ddp", "az2", "fsdp2", "az3", "ds3"]
LLAMA_LAYERS = 4
LLAMA = dict(intermediate=1408, heads=8, vocab=16000)
"""At hidden 512: about 29M parameters (117 MB fp32), untied: the embedding and the LM head are two 33 MB tensors."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="*", default=[4, 2])
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system (default 20)")
    parser.add_argument("--ds3_steps", type=int, default=None, help="timed steps for ds3 (default: --steps)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--grad_accums", type=int, nargs="+", default=[1], help="accumulation steps to run (1)")
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV)
    parser.add_argument("--out_dir", type=Path, default=launch.BENCH_DIR / "out" / "stage3")
    parser.add_argument("--json", type=Path, default=None, help="write the raw readings and summaries here")
    parser.add_argument(
        "--accumulation_from_json", type=Path, default=None, help="print the accumulation tables of a saved run"
    )
    parser.add_argument(
        "--arena_whole",
        action="store_true",
        help="count the engine's gradient arenas whole from their allocation, as a device allocator does "
        "([Note: resident pages against allocated bytes] in user_load.py)",
    )
    parser.add_argument("--no_load", action="store_true", help="skip the loading measurement")
    parser.add_argument("--load_only", action="store_true", help="only the loading measurement")
    parser.add_argument("--load_dir", type=Path, default=Path("/tmp/az_stage3_bench_llama"))
    parser.add_argument("--load_world_size", type=int, default=2)
    parser.add_argument("--load_overhead_mb", type=float, default=32.0, help="overhead in the loading target (32)")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ training
def train_arena_whole(**kwargs: Any) -> dict[str, Any]:
    """Rank function: `steps.train` with the engine's gradient arenas counted whole from their allocation, as a
    device allocator counts them ([Note: resident pages against allocated bytes] in user_load.py)."""
    from user_load import count_gradient_arenas_whole

    if kwargs["system"].startswith("az"):
        count_gradient_arenas_whole()
    return steps.train(**kwargs)


def run_world(world_size: int, args: argparse.Namespace, grad_accum: int = 1) -> dict[str, list[dict[str, Any]]]:
    """Runs every system on `world_size` processes; returns each one's per-rank records."""
    out_dir = args.out_dir / (f"w{world_size}" if grad_accum == 1 else f"w{world_size}_accum{grad_accum}")
    raw = {}
    for system in args.systems:
        timed = args.ds3_steps if system == "ds3" and args.ds3_steps else args.steps
        ranks = steps.launch_train(
            system, world_size, out_dir=out_dir, ds_venv=args.ds_venv, steps=timed, warmup=args.warmup,
            grad_accum=grad_accum, function=train_arena_whole if args.arena_whole else None,
        )  # fmt: skip
        if ranks is not None:
            raw[system] = ranks
    return raw


def training_tables(summaries: list[Summary]) -> str:
    """Memory, bytes (against 3Ψ(W−1)/W·4) and time of every system, its ratios to DDP and FSDP2."""
    by = {s.system: s for s in summaries}
    ddp, fsdp2 = by.get("ddp"), by.get("fsdp2")
    columns = [
        "system", "RSS per rank (MB)", "anonymous RSS (MB)", "peak RSS (MB)", "engine-held (MB)", "live tensors (MB)",
        "ZeRO formula (MB)", "RSS / DDP", "anon / DDP", "bytes per step per rank (MB, counted by)",
        "formula 3Ψ(W−1)/W·4 (MB)", "counted / 3Ψ formula", "wire bytes per step (MB)", "step ms (median)", "p25–p75",
        "CPU ms/step", "step / DDP", "step / FSDP2", "final loss",
    ]  # fmt: skip
    rows = []
    for s in summaries:
        formula3 = comm_formula_bytes(s.params, s.world_size, 3) / MB
        rows.append((
            f"{s.system}: {PEERS[s.system].label}", f"{s.rss_mb:.1f}", f"{s.anon_rss_mb:.1f}", fmt(s.peak_rss_mb),
            fmt(s.held_mb), f"{s.live_tensor_mb:.1f}",
            f"{FORMULA_TEXT[PEERS[s.system].memory]} = {s.memory_formula_mb:.1f}",
            ratio(s.rss_mb, ddp and ddp.rss_mb), ratio(s.anon_rss_mb, ddp and ddp.anon_rss_mb),
            f"{s.comm_mb_per_step:.1f} ({PEERS[s.system].counted_by})", f"{formula3:.1f}",
            f"{s.comm_mb_per_step / formula3:.3f}", f"{s.wire_mb_per_step:.1f}", f"{s.step_ms:.0f}",
            f"{s.step_ms_p25_p75[0]:.0f}–{s.step_ms_p25_p75[1]:.0f}", f"{s.cpu_ms_per_rank:.0f}",
            ratio(s.step_ms, ddp and ddp.step_ms), ratio(s.step_ms, fsdp2 and fsdp2.step_ms), f"{s.final_loss:.7f}",
        ))  # fmt: skip
    out = report.table(columns, rows)
    held = [s for s in summaries if s.memory_breakdown]
    if held:
        keys = [k for k in held[0].memory_breakdown if k != "total"] + ["total"]
        rows = [(s.system, *(f"{s.memory_breakdown.get(k, 0) / MB:.2f}" for k in keys)) for s in held]
        out += "\n\nengine.memory_breakdown() on rank 0 (MB)\n\n" + report.table(["system", *keys], rows)
    return out + "\n\nCollectives as each system counted them\n\n" + report.comm_kind_table(summaries)


def training_checks(by: dict[str, Summary]) -> list[str]:
    """Stage 3's targets (issue 3) against DDP, FSDP2 and DeepSpeed stage 3, as PASS/FAIL/SKIP lines."""
    az3, ddp, fsdp2, ds3 = (by.get(k) for k in ("az3", "ddp", "fsdp2", "ds3"))
    if az3 is None:
        return []
    lines = []
    W = az3.world_size
    if ddp:
        ok = az3.rss_mb <= 0.45 * ddp.rss_mb and az3.anon_rss_mb <= 0.45 * ddp.anon_rss_mb
        detail = (
            f"RSS {az3.rss_mb:.1f} / {ddp.rss_mb:.1f} MB = {az3.rss_mb / ddp.rss_mb:.3f}; anonymous "
            f"{az3.anon_rss_mb:.1f} / {ddp.anon_rss_mb:.1f} MB = {az3.anon_rss_mb / ddp.anon_rss_mb:.3f}"
        )
        lines.append(Check(f"stage 3 RSS at W={W} <= 0.45 x DDP", ok, detail))
    if fsdp2:
        ok = az3.rss_mb <= fsdp2.rss_mb and az3.anon_rss_mb <= fsdp2.anon_rss_mb
        detail = (
            f"RSS {az3.rss_mb:.1f} vs {fsdp2.rss_mb:.1f} MB; "
            f"anonymous {az3.anon_rss_mb:.1f} vs {fsdp2.anon_rss_mb:.1f} MB"
        )
        lines.append(Check(f"stage 3 RSS at W={W} <= FSDP2", ok, detail))
    formula = comm_formula_bytes(az3.params, W, 3) / MB
    value = az3.comm_mb_per_step / formula
    kinds = ", ".join(
        f"{k} {v['bytes_per_rank'] / az3.steps / MB:.1f}" for k, v in az3.comm_by_kind.items() if k != "total"
    )
    detail = (
        f"counted {az3.comm_mb_per_step:.1f} MB vs formula {formula:.1f} MB = {value:.3f} "
        f"(by kind: {kinds}; wire {az3.wire_mb_per_step:.1f})"
    )
    if value > 1.05:  # the engine before 12dcef0 all-reduced the gradients on gloo: 4Ψ(W−1)/W, 4/3 of the formula
        detail += f"; gradients all-reduced, not reduce-scattered? counted / 4Ψ(W−1)/W = {value * 3 / 4:.3f}"
    lines.append(Check(f"stage 3 bytes per step at W={W} within 5% of 3Ψ(W−1)/W", abs(value - 1) <= 0.05, detail))
    if fsdp2:
        detail = (
            f"{az3.step_ms:.0f} vs {fsdp2.step_ms:.0f} ms = {az3.step_ms / fsdp2.step_ms:.2f} "
            f"(CPU ms per step {az3.cpu_ms_per_rank:.0f} vs {fsdp2.cpu_ms_per_rank:.0f})"
        )
        lines.append(Check(f"stage 3 step time at W={W} <= 1.1 x FSDP2", az3.step_ms <= 1.1 * fsdp2.step_ms, detail))
    name = f"stage 3 step time at W={W} below DeepSpeed stage 3"
    if ds3 is None:
        lines.append(Check(name, None, "DeepSpeed not run"))
    else:
        detail = (
            f"{az3.step_ms:.0f} vs {ds3.step_ms:.0f} ms = {az3.step_ms / ds3.step_ms:.2f} "
            f"({ds3.steps} timed steps for ds3)"
        )
        lines.append(Check(name, az3.step_ms < ds3.step_ms, detail))
    return [check.line() for check in lines]


# ------------------------------------------------------------------------------------------------ accumulation
def _peak_per_rank_mb(ranks: list[dict[str, Any]]) -> list[float]:
    """VmHWM at the end of the run (reset at the baseline) minus the baseline VmRSS, per rank."""
    return [(r["after"]["VmHWM"] - r["baseline"]["VmRSS"]) / MB for r in ranks]


def _max_micro(ranks: list[dict[str, Any]], key: str) -> float | None:
    values = [r["extra"].get("micro", {}).get(key) for r in ranks]
    return max((v for v in values if v is not None), default=None)


def accumulation_table(by_accum: dict[int, dict[str, list[dict[str, Any]]]]) -> tuple[str, list[str]]:
    """Peak memory per rank of every system at every accumulation; the check that stage 3's does not grow."""
    accums = sorted(by_accum)
    first = accums[0]
    peaks = {
        a: {system: max(_peak_per_rank_mb(ranks)) for system, ranks in raw.items()} for a, raw in by_accum.items()
    }
    columns = [
        "system", "accumulation", "peak RSS − baseline per rank (MB, each rank)", "peak (MB, max)",
        f"peak / same system at accumulation {first}", "peak / DDP", "peak / FSDP2",
        "RSS between micro-steps (MB, max)",
        "RSS after the run (MB, max)", "engine gradients kept between micro-steps (MB)",
        "stage-3 units gathered between micro-steps", "scheduler peak gathered elements (largest unit)",
        "engine peak full-size gradient buffers (MB)", "engine-held total (MB)",
    ]  # fmt: skip
    rows = []
    for system in dict.fromkeys(system for raw in by_accum.values() for system in raw):
        for accum in (a for a in accums if system in by_accum[a]):
            ranks, peak = by_accum[accum][system], peaks[accum][system]
            between, grads = _max_micro(ranks, "max_rss_between"), _max_micro(ranks, "max_engine_grad_bytes_between")
            live, unit = _max_micro(ranks, "scheduler_peak_live_numel"), _max_micro(ranks, "largest_unit_numel")
            transient = _max_micro(ranks, "reducer_peak_transient_bytes")
            gathered = _max_micro(ranks, "max_gathered_units_between")
            breakdowns = [r["extra"].get("memory_breakdown") for r in ranks]
            rows.append((
                system, accum, " / ".join(f"{p:.1f}" for p in _peak_per_rank_mb(ranks)), f"{peak:.1f}",
                ratio(peak, peaks[first].get(system)), ratio(peak, peaks[accum].get("ddp")),
                ratio(peak, peaks[accum].get("fsdp2")), "-" if between is None else f"{between / MB:.1f}",
                f"{max(r['after']['VmRSS'] - r['baseline']['VmRSS'] for r in ranks) / MB:.1f}",
                "-" if grads is None else f"{grads / MB:.1f}", "-" if gathered is None else gathered,
                "-" if live is None else f"{live:,} ({unit:,})", "-" if transient is None else f"{transient / MB:.1f}",
                fmt(max(b["total"] for b in breakdowns) / MB if all(breakdowns) else None),
            ))  # fmt: skip
    lines = []
    for accum in (a for a in accums[1:] if "az3" in peaks[first] and "az3" in peaks[a]):
        value = peaks[accum]["az3"] / peaks[first]["az3"]
        detail = f"{peaks[accum]['az3']:.1f} vs {peaks[first]['az3']:.1f} MB = {value:.3f}"
        name = f"stage 3 peak RSS at accumulation {accum} within 10% of accumulation {first}"
        lines.append(Check(name, abs(value - 1) <= 0.10, detail).line())
    return report.table(columns, rows), lines


def accumulation_from_json(path: Path) -> None:
    """Prints the accumulation table of every world size a saved run (`--json`) holds; runs nothing."""
    by_world: dict[int, dict[int, dict[str, list[dict[str, Any]]]]] = {}
    for key, world in json.loads(path.read_text())["worlds"].items():
        size, _, accum = str(key).partition("_accum")
        by_world.setdefault(int(size), {})[int(accum or 1)] = world["raw"]
    for world_size, by_accum in sorted(by_world.items()):
        table, lines = accumulation_table(by_accum)
        print(f"### W = {world_size}: peak memory per rank under gradient accumulation\n\n{table}\n")
        print("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------- loading
def save_llama(folder: str) -> dict[str, Any]:
    """Rank function (one process): saves the Llama once; returns its sizes."""
    sizes_path = Path(folder) / "bench_sizes.json"
    if not sizes_path.exists():
        model = models.llama(models.llama_config(512, LLAMA_LAYERS, **LLAMA))
        model.save_pretrained(folder)
        nbytes = [p.numel() * p.element_size() for p in model.parameters()]
        layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        sizes = {"model_bytes": sum(nbytes), "layer_bytes": layer, "largest_tensor_bytes": max(nbytes)}
        sizes_path.write_text(json.dumps({**sizes, "params": sum(p.numel() for p in model.parameters())}))
    return json.loads(sizes_path.read_text())


def load(system: str, folder: str) -> dict[str, Any]:
    """Rank function: loads `folder` once (load_az3 partitioned, load_hf whole); memory after it and its peaks.

    Both loaders import the same things before the baseline (the Llama modeling module and accelerate's
    init_empty_weights included), so that the reading holds the loading alone.
    """
    import accelerate  # noqa: F401
    import torch
    from harness.readings import PeakSampler, live_tensor_bytes, proc_status
    from transformers import LlamaForCausalLM

    import accelerate_zero

    measurement = steps.start_measurement()
    with PeakSampler(("RssAnon", "RssFile")) as sampled:  # VmHWM does not split anonymous from file-backed pages
        if system == "load_az3":
            model = accelerate_zero.from_pretrained(LlamaForCausalLM, folder, config=models.engine_config(3))
        else:
            model = LlamaForCausalLM.from_pretrained(folder)
    gc.collect()
    measurement.after = proc_status()
    measurement.extra["sampled_peak"] = sampled.peak
    # transformers may leave parameters as views of the mmap-ed safetensors file, not yet read: touch every one
    # (as the first forward would) and read again.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sum()
    measurement.extra["after_touch"] = proc_status()
    measurement.params = sum(p.numel() for p in model.parameters())
    measurement.live_tensor_bytes = live_tensor_bytes()
    return vars(measurement)


def _most_mb(ranks: list[dict[str, Any]], read: Callable[[dict[str, Any]], float]) -> str:
    return f"{max(read(r) for r in ranks) / MB:.1f}"


def run_loading(args: argparse.Namespace) -> tuple[str, list[str], dict[str, Any]]:
    """Both loaders at --load_world_size; the table and the check of the partitioned peak."""
    args.load_dir.mkdir(parents=True, exist_ok=True)
    out_dir = args.out_dir / "load"
    sizes = launch.on_ranks(1, save_llama, {"folder": str(args.load_dir)}, out_dir=out_dir, backend="none").results[0]
    raw, W = {}, args.load_world_size
    for system in ("load_az3", "load_hf"):
        try:
            raw[system] = launch.on_ranks(
                W, load, {"system": system, "folder": str(args.load_dir)}, name=system, out_dir=out_dir
            ).results
        except launch.LaunchFailed as failed:
            print(f"  FAILED {failed}")
    columns = [
        f"loader (W={W})", "peak RSS per rank: VmHWM − baseline (MB, each rank)", "RSS after (MB, max)",
        "anonymous RSS after (MB, max)", "live tensors after (MB, max)", "sampled peak RssAnon − baseline (MB)",
        "sampled peak RssFile − baseline (MB)", "VmHWM − baseline after touching every parameter (MB)",
    ]  # fmt: skip
    peaks, rows = {}, []
    for system, ranks in raw.items():
        per_rank = [(r["after"]["VmHWM"] - r["baseline"]["VmRSS"]) / MB for r in ranks]
        peaks[system] = max(per_rank)
        most = functools.partial(_most_mb, ranks)
        rows.append((
            system, " / ".join(f"{p:.1f}" for p in per_rank),
            most(lambda r: r["after"]["VmRSS"] - r["baseline"]["VmRSS"]),
            most(lambda r: r["after"]["RssAnon"] - r["baseline"]["RssAnon"]), most(lambda r: r["live_tensor_bytes"]),
            most(lambda r: r["extra"]["sampled_peak"]["RssAnon"] - r["baseline"]["RssAnon"]),
            most(lambda r: r["extra"]["sampled_peak"]["RssFile"] - r["baseline"].get("RssFile", 0)),
            most(lambda r: r["extra"]["after_touch"]["VmHWM"] - r["baseline"]["VmRSS"]),
        ))  # fmt: skip
    model_mb, layer_mb, largest_mb = (sizes[k] / MB for k in ("model_bytes", "layer_bytes", "largest_tensor_bytes"))
    # What no decoder layer owns (embedding, LM head, final norm) forms one more unit, read whole at load time.
    rest_mb = model_mb - LLAMA_LAYERS * layer_mb
    unit_mb = max(layer_mb, rest_mb)
    bound = model_mb / W + unit_mb + args.load_overhead_mb
    table = (
        f"Model: {sizes['params']:,} parameters = {model_mb:.1f} MB fp32; one decoder layer {layer_mb:.1f} MB; "
        f"largest single tensor {largest_mb:.1f} MB; the unit of what no decoder layer owns (embedding, LM head, "
        f"final norm) {rest_mb:.1f} MB: the largest unit\n\n" + report.table(columns, rows)
    )
    lines = []
    if "load_az3" in peaks:
        name = f"partitioned loading peak at W={W} <= model/W + one unit + {args.load_overhead_mb:.0f} MB overhead"
        detail = (
            f"VmHWM − baseline {peaks['load_az3']:.1f} MB vs {model_mb:.1f}/{W} + {unit_mb:.1f} + "
            f"{args.load_overhead_mb:.0f} = {bound:.1f} MB (transformers from_pretrained: "
            f"{peaks.get('load_hf', float('nan')):.1f} MB)"
        )
        lines.append(Check(name, peaks["load_az3"] <= bound, detail).line())
        anon = max(r["extra"]["sampled_peak"]["RssAnon"] - r["baseline"]["RssAnon"] for r in raw["load_az3"]) / MB
        name = "partitioned loading, anonymous memory only (sampled RssAnon peak − baseline) <= the same bound"
        detail = (
            f"{anon:.1f} MB vs {bound:.1f} MB; the rest of VmHWM is file-backed pages of the safetensors file "
            "(page cache, shared by the ranks, counted in each rank's RSS)"
        )
        lines.append(Check(name, anon <= bound, detail).line())
    return table, lines, {"raw": raw, "sizes": sizes, "peaks_mb": peaks, "bound_mb": bound}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.accumulation_from_json is not None:
        accumulation_from_json(args.accumulation_from_json)
        return
    facts = report.machine_facts()
    args.systems = steps.runnable(args.systems, args.ds_venv)
    print(report.header(facts, "stage3_bench: stage 3 against DDP, stage 2, FSDP2 and DeepSpeed stage 3"))
    payload: dict[str, Any] = {"args": vars(args), "worlds": {}}
    all_lines: list[str] = []
    for world_size in [] if args.load_only else args.world_sizes:
        by_accum: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for accum in args.grad_accums:
            print(f"W = {world_size}, accumulation {accum}: {', '.join(args.systems)}", flush=True)
            raw = run_world(world_size, args, accum)
            summaries = [summarize(system, [ranks]) for system, ranks in raw.items()]
            if not summaries:
                continue
            by_accum[accum] = raw
            print(
                f"\n### W = {world_size}, Ψ = {summaries[0].params:,} parameters, {summaries[0].steps} timed steps of "
                f"{accum} micro-step(s) (ds3: see its row); MB = 10^6 bytes\n\n{training_tables(summaries)}"
            )
            # The targets (bytes and time per step) were set for one micro-step per optimizer step.
            lines = training_checks({s.system: s for s in summaries}) if accum == 1 else []
            print("\n" + "\n".join(lines) + "\n", flush=True)
            all_lines += lines
            key = world_size if accum == 1 else f"{world_size}_accum{accum}"
            payload["worlds"][key] = {"raw": raw, "summaries": [vars(s) for s in summaries]}
        if len(by_accum) > 1:
            table, lines = accumulation_table(by_accum)
            print(f"\n### W = {world_size}: peak memory per rank under gradient accumulation\n\n{table}\n")
            print("\n".join(lines) + "\n", flush=True)
            all_lines += lines
    if not args.no_load:
        table, lines, payload["load"] = run_loading(args)
        print(f"\n### Loading a saved LlamaForCausalLM\n\n{table}\n\n" + "\n".join(lines))
        all_lines += lines
    payload["checks"] = all_lines
    if args.json is not None:
        report.save_json(args.json, payload, facts)


if __name__ == "__main__":
    main()
