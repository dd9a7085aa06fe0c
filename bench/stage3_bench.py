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

The training systems run on the same model, data and machinery as engine_bench.py (bench_common.py,
bench_worker.py, ds_worker.py, report.py: 16 x Linear(1024, 1024), fp32 AdamW, gloo, one thread per rank,
MALLOC_MMAP_THRESHOLD_=131072, each system in its own fresh torchrun group). Stage 3 (az3, ds3) uses
{"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 2100000,
"stage3_max_live_parameters": 4200000}: each Linear is a gather unit. FSDP2 is `fully_shard` on each Linear then
the root, reshard_after_forward=True.

Gradient accumulation (`--grad_accums 1 4`): every system runs once per accumulation, each optimizer step being
that many micro-steps (forward + backward each; how each system accumulates: bench_worker.MicroProbe), and an
extra table shows each system's peak RSS per rank against accumulation 1, the RSS between micro-steps and, for
accelerate_zero, the gradient bytes kept between micro-steps and the scheduler's peak of gathered elements.

Loading: a LlamaForCausalLM (~29M parameters) is saved with save_pretrained into --load_dir (once), then loaded at
--load_world_size processes by `accelerate_zero.from_pretrained(LlamaForCausalLM, dir, config=zero3)` (load_az3)
and by `LlamaForCausalLM.from_pretrained(dir)` (load_hf); the reading is VmHWM after loading minus VmRSS at the
baseline (taken after importing torch, transformers and accelerate_zero and creating the process group).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import engine_bench
import report
from bench_worker import ARENA_WHOLE_ENV
from ds_venv import DEFAULT_DS_VENV


BENCH_DIR = Path(__file__).resolve().parent
SYSTEMS = ["ddp", "az2", "fsdp2", "az3", "ds3"]
MB = report.MB

# A Llama of about 29M parameters (117 MB in fp32) for the loading measurement; not tied, so that the
# embedding and the LM head are two separate 33 MB tensors.
LLAMA = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=16000,
    tie_word_embeddings=False,
)
SAVE_SCRIPT = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[2])))
model.save_pretrained(sys.argv[1])
layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
largest_tensor = max(p.numel() * p.element_size() for p in model.parameters())
total = sum(p.numel() * p.element_size() for p in model.parameters())
json.dump({"model_bytes": total, "layer_bytes": layer, "largest_tensor_bytes": largest_tensor,
           "params": sum(p.numel() for p in model.parameters())}, open(sys.argv[1] + "/bench_sizes.json", "w"))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="*", default=[4, 2])
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system (default 20)")
    parser.add_argument("--ds3_steps", type=int, default=None, help="timed steps for ds3 (default: --steps)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--grad_accums",
        type=int,
        nargs="+",
        default=[1],
        help="run every system at each of these gradient accumulation steps (default: 1 only)",
    )
    parser.add_argument("--ds_venv", type=Path, default=DEFAULT_DS_VENV)
    parser.add_argument("--out_dir", type=Path, default=BENCH_DIR / "out" / "stage3")
    parser.add_argument("--json", type=Path, default=None, help="write the raw readings and summaries here")
    parser.add_argument(
        "--accumulation_from_json",
        type=Path,
        default=None,
        help="print the accumulation tables of a run saved with --json (and --grad_accums); run nothing",
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
    parser.add_argument(
        "--load_overhead_mb", type=float, default=32.0, help="allowed overhead in the loading target (default 32)"
    )
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------ training
def run_world(world_size: int, args: argparse.Namespace, grad_accum: int = 1) -> dict[str, list[dict[str, Any]]]:
    """Runs every system on `world_size` processes; returns each one's per-rank raw readings."""
    raw: dict[str, list[dict[str, Any]]] = {}
    systems = list(args.systems)
    if "ds3" in systems and not (args.ds_venv / "bin" / "torchrun").exists():
        print(f"no DeepSpeed virtualenv at {args.ds_venv}: skipping ds3")
        systems.remove("ds3")
    if "ds3" in systems and grad_accum != 1:
        print(f"ds_worker.py has no gradient accumulation: skipping ds3 at accumulation {grad_accum}")
        systems.remove("ds3")
    for system in systems:
        steps = args.ds3_steps if system == "ds3" and args.ds3_steps else args.steps
        run_args = argparse.Namespace(
            world_size=world_size,
            steps=steps,
            warmup=args.warmup,
            reduce_bucket_size=None,
            ds_venv=args.ds_venv,
            out_dir=args.out_dir / (f"w{world_size}" if grad_accum == 1 else f"w{world_size}_accum{grad_accum}"),
            grad_accum=grad_accum,
        )
        run_args.out_dir.mkdir(parents=True, exist_ok=True)
        ranks = engine_bench.run_system(system, run_args, 0)
        if ranks is not None:
            raw[system] = ranks
    return raw


def stage3_comm_formula_bytes(params: int, world_size: int) -> float:
    """3Ψ(W−1)/W elements of 4 bytes: all-gather in forward, all-gather in backward, reduce-scatter of gradients."""
    return 3 * params * (world_size - 1) / world_size * report.BYTES_FP32


def training_tables(summaries: list[report.Summary]) -> str:
    by = {s.system: s for s in summaries}
    ddp, fsdp2 = by.get("ddp"), by.get("fsdp2")
    rows = [
        "| system | RSS per rank (MB) | anonymous RSS (MB) | peak RSS (MB) | engine-held (MB) | live tensors (MB) | "
        "ZeRO formula (MB) | RSS / DDP | anon / DDP | bytes per step per rank (MB, counted by) | "
        "formula 3Ψ(W−1)/W·4 (MB) | counted / 3Ψ formula | wire bytes per step (MB) | step ms (median) | "
        "p25–p75 | CPU ms/step | step / DDP | step / FSDP2 | final loss |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        formula3 = stage3_comm_formula_bytes(s.params, s.world_size) / MB
        rows.append(
            f"| {s.system}: {report.LABELS[s.system]} | {s.rss_mb:.1f} | {s.anon_rss_mb:.1f} | "
            f"{report._fmt(s.peak_rss_mb)} | {report._fmt(s.held_mb)} | {s.live_tensor_mb:.1f} | "
            f"{report.FORMULA_TEXT[report.MEMORY_FORMULA[s.system]]} = {s.memory_formula_mb:.1f} | "
            f"{report._ratio(s.rss_mb, ddp.rss_mb if ddp else None)} | "
            f"{report._ratio(s.anon_rss_mb, ddp.anon_rss_mb if ddp else None)} | "
            f"{s.comm_mb_per_step:.1f} ({report.COUNTED_BY[s.system]}) | {formula3:.1f} | "
            f"{s.comm_mb_per_step / formula3:.3f} | {s.wire_mb_per_step:.1f} | {s.step_ms:.0f} | "
            f"{s.step_ms_p25_p75[0]:.0f}–{s.step_ms_p25_p75[1]:.0f} | {s.cpu_ms_per_rank:.0f} | "
            f"{report._ratio(s.step_ms, ddp.step_ms if ddp else None)} | "
            f"{report._ratio(s.step_ms, fsdp2.step_ms if fsdp2 else None)} | {s.final_loss:.7f} |"
        )
    out = "\n".join(rows)
    breakdown_rows = []
    for s in summaries:
        if s.memory_breakdown:
            keys = [k for k in s.memory_breakdown if k != "total"] + ["total"]
            if not breakdown_rows:
                breakdown_rows = [
                    "| system | " + " | ".join(keys) + " |",
                    "|---|" + "--:|" * len(keys),
                ]
            breakdown_rows.append(
                f"| {s.system} | " + " | ".join(f"{s.memory_breakdown.get(k, 0) / MB:.2f}" for k in keys) + " |"
            )
    if breakdown_rows:
        out += "\n\nengine.memory_breakdown() on rank 0 (MB)\n\n" + "\n".join(breakdown_rows)
    out += "\n\nCollectives as each system counted them\n\n" + report.comm_kind_table(summaries)
    return out


def check(name: str, passed: bool | None, detail: str) -> str:
    verdict = "SKIP" if passed is None else ("PASS" if passed else "FAIL")
    return f"{verdict}: {name}: {detail}"


def training_checks(by: dict[str, report.Summary]) -> list[str]:
    az3, ddp, fsdp2, ds3 = (by.get(k) for k in ("az3", "ddp", "fsdp2", "ds3"))
    lines = []
    if az3 and ddp:
        ok = az3.rss_mb <= 0.45 * ddp.rss_mb and az3.anon_rss_mb <= 0.45 * ddp.anon_rss_mb
        lines.append(
            check(
                f"stage 3 RSS at W={az3.world_size} <= 0.45 x DDP",
                ok,
                f"RSS {az3.rss_mb:.1f} / {ddp.rss_mb:.1f} MB = {az3.rss_mb / ddp.rss_mb:.3f}; anonymous "
                f"{az3.anon_rss_mb:.1f} / {ddp.anon_rss_mb:.1f} MB = {az3.anon_rss_mb / ddp.anon_rss_mb:.3f}",
            )
        )
    if az3 and fsdp2:
        ok = az3.rss_mb <= fsdp2.rss_mb and az3.anon_rss_mb <= fsdp2.anon_rss_mb
        lines.append(
            check(
                f"stage 3 RSS at W={az3.world_size} <= FSDP2",
                ok,
                f"RSS {az3.rss_mb:.1f} vs {fsdp2.rss_mb:.1f} MB; anonymous {az3.anon_rss_mb:.1f} vs "
                f"{fsdp2.anon_rss_mb:.1f} MB",
            )
        )
    if az3:
        formula = stage3_comm_formula_bytes(az3.params, az3.world_size) / MB
        ratio = az3.comm_mb_per_step / formula
        kinds = {k: v["bytes_per_rank"] / az3.steps / MB for k, v in az3.comm_by_kind.items() if k != "total"}
        lines.append(
            check(
                f"stage 3 bytes per step at W={az3.world_size} within 5% of 3Ψ(W−1)/W",
                abs(ratio - 1) <= 0.05,
                f"counted {az3.comm_mb_per_step:.1f} MB vs formula {formula:.1f} MB = {ratio:.3f} "
                f"(by kind: {', '.join(f'{k} {v:.1f}' for k, v in kinds.items())}; wire {az3.wire_mb_per_step:.1f})"
                + (
                    "; the gradients were reduced with an all-reduce (2Ψ(W−1)/W) instead of a reduce-scatter "
                    "(Ψ(W−1)/W): the engine before commit 12dcef0 (see accelerate_zero/engine/collectives.py, "
                    "[Note: reduce-scatter on gloo]) did so on gloo, which makes 4Ψ(W−1)/W = 4/3 of the formula: "
                    f"counted / 4Ψ(W−1)/W = {ratio * 3 / 4:.3f}"
                    if ratio > 1.05
                    else ""
                ),
            )
        )
    if az3 and fsdp2:
        lines.append(
            check(
                f"stage 3 step time at W={az3.world_size} <= 1.1 x FSDP2",
                az3.step_ms <= 1.1 * fsdp2.step_ms,
                f"{az3.step_ms:.0f} vs {fsdp2.step_ms:.0f} ms = {az3.step_ms / fsdp2.step_ms:.2f} "
                f"(CPU ms per step {az3.cpu_ms_per_rank:.0f} vs {fsdp2.cpu_ms_per_rank:.0f})",
            )
        )
    if az3:
        lines.append(
            check(
                f"stage 3 step time at W={az3.world_size} below DeepSpeed stage 3",
                None if ds3 is None else az3.step_ms < ds3.step_ms,
                "DeepSpeed not run"
                if ds3 is None
                else f"{az3.step_ms:.0f} vs {ds3.step_ms:.0f} ms = {az3.step_ms / ds3.step_ms:.2f} "
                f"({ds3.steps} timed steps for ds3)",
            )
        )
    return lines


# ------------------------------------------------------------------------------------------------ accumulation
def _peak_per_rank_mb(ranks: list[dict[str, Any]]) -> list[float]:
    """VmHWM at the end of the run (reset at the baseline) minus the baseline VmRSS, per rank."""
    return [(r["after"]["VmHWM"] - r["baseline"]["VmRSS"]) / MB for r in ranks]


def _max_micro(ranks: list[dict[str, Any]], key: str) -> float | None:
    values = [r["extra"].get("micro", {}).get(key) for r in ranks]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def accumulation_table(by_accum: dict[int, dict[str, list[dict[str, Any]]]]) -> tuple[str, list[str]]:
    """Peak memory per rank of every system at every accumulation; the check that stage 3's does not grow."""
    accums = sorted(by_accum)
    first_accum = accums[0]
    rows = [
        "| system | accumulation | peak RSS − baseline per rank (MB, each rank) | peak (MB, max) | peak / same "
        "system at accumulation "
        f"{first_accum} | peak / DDP | peak / FSDP2 | RSS between micro-steps (MB, max) | RSS after the run "
        "(MB, max) | engine gradients kept between micro-steps (MB) | stage-3 units gathered between micro-steps | "
        "scheduler peak gathered elements (largest unit) | engine peak full-size gradient buffers (MB) | "
        "engine-held total (MB) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    peaks = {
        accum: {system: max(_peak_per_rank_mb(ranks)) for system, ranks in raw.items()}
        for accum, raw in by_accum.items()
    }
    systems = list(dict.fromkeys(system for raw in by_accum.values() for system in raw))
    for system in systems:
        for accum in accums:
            ranks = by_accum[accum].get(system)
            if ranks is None:
                continue
            peak = peaks[accum][system]
            base = peaks[first_accum].get(system)
            ddp, fsdp2 = peaks[accum].get("ddp"), peaks[accum].get("fsdp2")
            between = _max_micro(ranks, "max_rss_between")
            grads = _max_micro(ranks, "max_engine_grad_bytes_between")
            gathered = _max_micro(ranks, "max_gathered_units_between")
            live = _max_micro(ranks, "scheduler_peak_live_numel")
            unit = _max_micro(ranks, "largest_unit_numel")
            transient = _max_micro(ranks, "reducer_peak_transient_bytes")
            breakdowns = [r["extra"].get("memory_breakdown") for r in ranks]
            held = max(b["total"] for b in breakdowns) / MB if all(breakdowns) else None
            rows.append(
                f"| {system} | {accum} | {' / '.join(f'{p:.1f}' for p in _peak_per_rank_mb(ranks))} | {peak:.1f} | "
                f"{report._ratio(peak, base)} | {report._ratio(peak, ddp)} | {report._ratio(peak, fsdp2)} | "
                f"{'-' if between is None else f'{between / MB:.1f}'} | "
                f"{max(r['after']['VmRSS'] - r['baseline']['VmRSS'] for r in ranks) / MB:.1f} | "
                f"{'-' if grads is None else f'{grads / MB:.1f}'} | {'-' if gathered is None else gathered} | "
                f"{'-' if live is None else f'{live:,} ({unit:,})'} | "
                f"{'-' if transient is None else f'{transient / MB:.1f}'} | {report._fmt(held)} |"
            )
    lines = []
    for system in ("az3",):
        if system not in peaks[first_accum]:
            continue
        for accum in accums[1:]:
            if system in peaks[accum]:
                ratio = peaks[accum][system] / peaks[first_accum][system]
                lines.append(
                    check(
                        f"stage 3 peak RSS at accumulation {accum} within 10% of accumulation {first_accum}",
                        abs(ratio - 1) <= 0.10,
                        f"{peaks[accum][system]:.1f} vs {peaks[first_accum][system]:.1f} MB = {ratio:.3f}",
                    )
                )
    return "\n".join(rows), lines


# ------------------------------------------------------------------------------------------------- loading
def save_llama(folder: Path) -> dict[str, Any]:
    sizes = folder / "bench_sizes.json"
    if not sizes.exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", SAVE_SCRIPT, str(folder), json.dumps(LLAMA)], check=True)
    return json.loads(sizes.read_text())


def run_loading(args: argparse.Namespace) -> tuple[str, list[str], dict[str, Any]]:
    sizes = save_llama(args.load_dir)
    run_args = argparse.Namespace(
        world_size=args.load_world_size,
        steps=0,
        warmup=0,
        reduce_bucket_size=None,
        ds_venv=args.ds_venv,
        out_dir=args.out_dir / "load",
        worker_extra={s: ["--load_dir", str(args.load_dir)] for s in ("load_az3", "load_hf")},
    )
    run_args.out_dir.mkdir(parents=True, exist_ok=True)
    raw = {}
    for system in ("load_az3", "load_hf"):
        ranks = engine_bench.run_system(system, run_args, 0)
        if ranks is not None:
            raw[system] = ranks
    W = args.load_world_size
    rows = [
        f"| loader (W={W}) | peak RSS per rank: VmHWM − baseline (MB, each rank) | RSS after (MB, max) | "
        "anonymous RSS after (MB, max) | live tensors after (MB, max) | sampled peak RssAnon − baseline (MB) | "
        "sampled peak RssFile − baseline (MB) | VmHWM − baseline after touching every parameter (MB) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    peaks = {}
    for system, ranks in raw.items():
        per_rank = [(r["after"]["VmHWM"] - r["baseline"]["VmRSS"]) / MB for r in ranks]
        peaks[system] = max(per_rank)
        rows.append(
            f"| {system} | {' / '.join(f'{p:.1f}' for p in per_rank)} | "
            f"{max(r['after']['VmRSS'] - r['baseline']['VmRSS'] for r in ranks) / MB:.1f} | "
            f"{max(r['after']['RssAnon'] - r['baseline']['RssAnon'] for r in ranks) / MB:.1f} | "
            f"{max(r['live_tensor_bytes'] for r in ranks) / MB:.1f} | "
            f"{max(r['extra']['sampled_peak']['RssAnon'] - r['baseline']['RssAnon'] for r in ranks) / MB:.1f} | "
            f"{max(r['extra']['sampled_peak']['RssFile'] - r['baseline'].get('RssFile', 0) for r in ranks) / MB:.1f} | "
            f"{max(r['extra']['after_touch']['VmHWM'] - r['baseline']['VmRSS'] for r in ranks) / MB:.1f} |"
        )
    model_mb, layer_mb, largest_mb = (sizes[k] / MB for k in ("model_bytes", "layer_bytes", "largest_tensor_bytes"))
    # What no decoder layer owns (embedding, LM head, final norm) forms one more unit, read whole at load time.
    rest_mb = model_mb - LLAMA["num_hidden_layers"] * layer_mb
    unit_mb = max(layer_mb, rest_mb)
    bound = model_mb / W + unit_mb + args.load_overhead_mb
    table = (
        f"Model: {sizes['params']:,} parameters = {model_mb:.1f} MB fp32; one decoder layer {layer_mb:.1f} MB; "
        f"largest single tensor {largest_mb:.1f} MB; the unit of what no decoder layer owns (embedding, LM head, "
        f"final norm) {rest_mb:.1f} MB: the largest unit\n\n" + "\n".join(rows)
    )
    lines = []
    if "load_az3" in peaks:
        lines.append(
            check(
                f"partitioned loading peak at W={W} <= model/W + one unit + {args.load_overhead_mb:.0f} MB overhead",
                peaks["load_az3"] <= bound,
                f"VmHWM − baseline {peaks['load_az3']:.1f} MB vs {model_mb:.1f}/{W} + {unit_mb:.1f} + {args.load_overhead_mb:.0f} = "
                f"{bound:.1f} MB (transformers from_pretrained: "
                f"{peaks.get('load_hf', float('nan')):.1f} MB)",
            )
        )
    if "load_az3" in raw:
        ranks = raw["load_az3"]
        anon = max(r["extra"]["sampled_peak"]["RssAnon"] - r["baseline"]["RssAnon"] for r in ranks) / MB
        lines.append(
            check(
                "partitioned loading, anonymous memory only (sampled RssAnon peak − baseline) <= the same bound",
                anon <= bound,
                f"{anon:.1f} MB vs {bound:.1f} MB; the rest of VmHWM is file-backed pages of the safetensors file "
                "(page cache, shared by the ranks, counted in each rank's RSS)",
            )
        )
    return table, lines, {"raw": raw, "sizes": sizes, "peaks_mb": peaks, "bound_mb": bound}


def accumulation_from_json(path: Path) -> None:
    """Prints the accumulation table of every world size a saved run (`--json`) holds; runs nothing."""
    worlds = json.loads(path.read_text())["worlds"]
    by_world: dict[int, dict[int, dict[str, list[dict[str, Any]]]]] = {}
    for key, world in worlds.items():
        size, _, accum = str(key).partition("_accum")
        by_world.setdefault(int(size), {})[int(accum or 1)] = world["raw"]
    for world_size, by_accum in sorted(by_world.items()):
        table, lines = accumulation_table(by_accum)
        print(f"### W = {world_size}: peak memory per rank under gradient accumulation\n\n{table}\n")
        print("\n".join(lines) + "\n")


def main() -> None:
    args = parse_args()
    if args.arena_whole:
        os.environ[ARENA_WHOLE_ENV] = "1"  # the workers inherit it (engine_bench.worker_command)
    if args.accumulation_from_json is not None:
        accumulation_from_json(args.accumulation_from_json)
        return
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "worlds": {}}
    all_lines: list[str] = []
    for world_size in [] if args.load_only else args.world_sizes:
        by_accum: dict[int, dict[str, list[dict[str, Any]]]] = {}
        for accum in args.grad_accums:
            print(f"W = {world_size}, accumulation {accum}: {', '.join(args.systems)}", flush=True)
            raw = run_world(world_size, args, accum)
            summaries = [report.summarize(system, [ranks]) for system, ranks in raw.items()]
            if not summaries:
                continue
            by_accum[accum] = raw
            first = summaries[0]
            print(
                f"\n### W = {world_size}, Ψ = {first.params:,} parameters, {first.steps} timed steps of {accum} "
                "micro-step(s) (ds3: see its row); MB = 10^6 bytes\n"
            )
            print(training_tables(summaries))
            # The targets (bytes and time per step) were set for one micro-step per optimizer step.
            lines = training_checks({s.system: s for s in summaries}) if accum == 1 else []
            print("\n" + "\n".join(lines) + "\n", flush=True)
            all_lines += lines
            key = world_size if accum == 1 else f"{world_size}_accum{accum}"
            payload["worlds"][key] = {"raw": raw, **report.as_json(summaries, [])}
        if len(by_accum) > 1:
            table, lines = accumulation_table(by_accum)
            print(f"\n### W = {world_size}: peak memory per rank under gradient accumulation\n\n{table}\n")
            print("\n".join(lines) + "\n", flush=True)
            all_lines += lines
    if not args.no_load:
        table, lines, load_payload = run_loading(args)
        print(f"\n### Loading a saved LlamaForCausalLM\n\n{table}\n\n" + "\n".join(lines))
        all_lines += lines
        payload["load"] = load_payload
    payload["checks"] = all_lines
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, default=str))
        print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    main()
