"""Writes bench/RESULTS.md and its PNG plots from the readings run_report.py collected (its report.json).

The estimate beside each measured memory number is `accelerate_zero.debug.estimate.estimate_stage` for the same
model, config (`models.engine_config`), world size and rank: the engine's own layout code, not a formula.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import engine_bench
import report_plots
import report_sections as sections
import stage3_bench
from harness import models
from harness.peers import PEERS
from harness.summary import Summary, summarize
from offload_bench import LADDER_LLAMA, ladder_llama


REPO = Path(__file__).resolve().parents[1]
SWEEP_LLAMA_LAYERS = sections.SWEEP_LLAMA_LAYERS


def estimates_for(
    sweep: dict[int, list[dict[str, Any]]], hidden: int, layers: int, model: str = "linear"
) -> dict[tuple[int, int, int], dict[str, int]]:
    """`estimate_stage(...).device` for every (stage, world size, rank) the sweep measured on `model`."""
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug.estimate import TrainingSetup, estimate_stage, shapes_from_module

    key, params_key = ("llama_stages", "llama_params") if model == "llama" else ("stages", "params")
    out = {}
    for world_size, ranks in sweep.items():
        for stage in map(int, ranks[0].get(key, {})):
            zero = ZeroConfig.from_any(models.engine_config(stage)).zero_optimization
            built = models.llama(ladder_llama(SWEEP_LLAMA_LAYERS), device="meta") if model == "llama" else None
            shapes = shapes_from_module(built or models.build_model(hidden, layers), zero)
            if shapes.numel != ranks[0][params_key]:
                raise ValueError(
                    f"the estimate's {model} has {shapes.numel=} parameters, the run {ranks[0][params_key]}"
                )
            setup = TrainingSetup(world_size, "no", "adamw", zero=zero)
            for rank in range(world_size):
                out[(stage, world_size, rank)] = dict(estimate_stage(shapes, setup, stage, rank=rank).device)
    return out


def _notes(summaries: list[Summary]) -> str:
    """Why a system's live tensors exceed its RSS by far, and the fixed non-tensor part of RSS at this Ψ."""
    notes = []
    for s in summaries:
        if s.live_tensor_mb > 2 * s.rss_mb:
            why = (" DeepSpeed stage 3 allocates its contiguous-gradients bucket up front as `torch.empty` of "
                   "reduce_bucket_size (5e8) fp32 elements = 2,000 MB." if s.system == "ds3" else "")  # fmt: skip
            notes.append(f"{PEERS[s.system].label}: its live tensors ({s.live_tensor_mb:,.0f} MB) exceed its RSS "
                         f"({s.rss_mb:,.0f} MB): RSS does not count allocated pages never written.{why}")  # fmt: skip
    torch_side = [s.rss_mb - s.live_tensor_mb for s in summaries if not s.system.startswith("ds")]
    if torch_side:
        notes.append(f"RSS minus live tensors is {min(torch_side):.0f}-{max(torch_side):.0f} MB for every torch and "
                     "accelerate_zero system (gloo, the allocator, code): a fixed part that weighs more at a smaller "
                     "Ψ than the 16.8M the memory targets were set for.")  # fmt: skip
    return "".join(f"\n\n{note}" for note in notes)


def _machine_lines(payload: dict[str, Any], summaries: list[Summary]) -> str:
    m, seconds = payload["machine"], payload["seconds"]
    readings = [value for s in summaries for pair in s.loadavg_1min if pair for value in pair]
    v, ds = m["versions"], payload.get("deepspeed_version")
    dirty = m["uncommitted_engine_files"]
    parts = ", ".join(f"{name} {seconds.get(name, 0) / 60:.1f}" for name in ("sweep", "systems", "offload", "trainer"))
    deepspeed = f", DeepSpeed {ds} (its own virtualenv)" if ds else ""
    changed = f", with {len(dirty)} uncommitted engine file(s) ({', '.join(dirty)})" if dirty else ""
    highest = f", {max(readings):.1f} at its highest between systems" if readings else ""
    start, end = payload["load_start"]["loadavg"][0], payload["load_end"]["loadavg"][0]
    return "\n".join([
        f"- Started {m['date']}; the runs took {seconds['total'] / 60:.1f} minutes ({parts}).",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, CPU only, gloo. Python "
        f"{m['python']}, torch {v['torch']}, transformers {v['transformers']}, accelerate {v['accelerate']}"
        f"{deepspeed}.",
        f"- Code: commit {m['commit']}{changed}.",
        f"- **Timing is on a {m['cores']}-core machine** (1-minute load average {start:.1f} at the start, {end:.1f} "
        f"at the end{highest}): step times are only meaningful as ratios to DDP in the same run.",
    ])  # fmt: skip


def _offload_section(offload: dict[str, Any]) -> str:
    if offload.get("status") == "json":
        return "Read from `bench/out/offload.json` (`--skip_offload_run`):\n\n" + offload["json"]["markdown"]
    if offload.get("status") == "no_json":
        return "Not run: `--skip_offload_run` was given and `bench/out/offload.json` does not exist."
    out = sections.question_section(offload, "python bench/offload_bench.py")
    saved = offload.get("saved_full_run")
    if saved:
        return out + ("\n\nThe largest-model part takes longer than this report's budget; the last full run of "
                      f"`python bench/offload_bench.py` (written {saved['written']}) found:"
                      f"\n\n{saved['markdown']}")  # fmt: skip
    return out + ("\n\nThe largest-model part takes longer than this report's budget and no saved full run "
                  "(`bench/out/offload.json`) exists: `python bench/offload_bench.py --part largest` runs "
                  "it.")  # fmt: skip


def write(payload: dict[str, Any], results: Path, plots_dir: Path) -> None:
    """Renders RESULTS.md at `results` and the PNGs into `plots_dir`."""
    args = payload["args"]
    hidden, layers = int(args["hidden"]), int(args["layers"])
    sweep = {int(w): ranks for w, ranks in payload["sweep"].items() if ranks}
    summaries = [summarize(system, rounds) for system, rounds in payload["main"].items() if rounds]
    by_name = {s.system: s for s in summaries}
    for s in summaries:
        if s.system.startswith("ds"):
            payload["deepspeed_version"] = payload["main"][s.system][0][0]["extra"].get("deepspeed_version")
    rows = sections.sweep_rows(sweep, estimates_for(sweep, hidden, layers))
    llama_rows = sections.sweep_rows(sweep, estimates_for(sweep, hidden, layers, "llama"), "llama")
    honesty, honest = sections.honesty_table(rows + llama_rows)
    world = summaries[0].world_size if summaries else "—"
    plots_dir.mkdir(parents=True, exist_ok=True)
    memory_png, comparison_png = plots_dir / "memory_vs_world_size.png", plots_dir / f"systems_w{world}.png"
    params = rows[0].params if rows else (summaries[0].params if summaries else 0)
    model = f"{layers} x Linear({hidden}, {hidden}), Ψ = {params:,} fp32 parameters, AdamW"
    report_plots.memory_vs_world_size(sections.plot_series(rows), memory_png, model)
    if summaries:
        report_plots.comparison(summaries, comparison_png, f"W = {world} processes on 2 shared cores; {model}")
    link = lambda path: os.path.relpath(path, results.parent)  # noqa: E731
    checks = [c.line() for c in engine_bench.checks(by_name)] + stage3_bench.training_checks(by_name)
    spread = sections.step_ratio_spread(summaries)
    notes = payload.get("notes", []) + [
        f"{s} failed: see its log in bench/out/report/." for s in payload.get("failed", [])
    ]
    worlds = ", ".join(str(w) for w in sorted(sweep))
    timed = summaries[0].steps if summaries else "—"
    noise = f": its two medians are {100 * (spread - 1):.0f}% apart, the noise floor of every ratio" if spread else ""
    verdict = "PASS: every" if honest else "FAIL: not every"
    llama_worlds = ", ".join(str(w) for w in sorted({r.world_size for r in llama_rows})) or "none (not measured)"
    text = f"""# Benchmark results

Written by `bench/report`; regenerate with the same command. What each section measures and how:
[README.md](README.md#benchmark-report). MB = 10^6 bytes. Model: {model}, one fixed random batch of 8 per rank, MSE
loss, gradient clipping off; every system trains the same model on the same data (the final losses agree).

{_machine_lines(payload, summaries)}{"".join(f"{chr(10)}- {note}" for note in notes)}

## Memory per rank, W = {world}

Max over ranks at the end of the run, beside the ZeRO formula for fp32 Adam.

{sections.memory_table(summaries)}{_notes(summaries)}

![memory per rank and step time of every system]({link(comparison_png)})

## Bytes moved and step time, W = {world}

Each system's own count of bytes per step per rank (ring convention) and the wire bytes; the median step time
({timed} timed steps after {args["warmup"]} warm-up, one thread per rank) as a ratio to DDP's, which ran first and
again last{noise}.

{sections.traffic_time_table(summaries, by_name.get("ddp"))}

Targets of the engine (issue 2) and stage 3 (issue 3) benchmarks, on this run:

{chr(10).join(f"- {line}" for line in checks)}

## Memory per rank against world size: measured and estimated

Stages 0-3 at W = {worlds} (run_report.py's sweep: at the end of a backward after one optimizer step, the whole model
state) against `accelerate_zero.debug.estimate.estimate_stage` for the same model, config, world size and rank.

![memory per rank against world size]({link(memory_png)})

{sections.sweep_table(rows)}

## Is the estimate honest?

Estimated model-state bytes per rank against `memory_breakdown()`, every rank: the Linear stack above, and a
LlamaForCausalLM of {SWEEP_LLAMA_LAYERS} layers of `offload_bench.py`'s ladder (vocabulary {LADDER_LLAMA["vocab"]},
intermediate {LADDER_LLAMA["intermediate"]}) at W = {llama_worlds}. **{verdict} estimate is within
{sections.HONESTY_TOLERANCE:.0%} of what the engine holds.**

{honesty}

## Offload

{_offload_section(payload["offload"])}

## The transformers Trainer: DDP, accelerate_zero and DeepSpeed

{sections.question_section(payload.get("trainer"), "python bench/trainer_bench.py", "Trainer, ")}

Goals (issue 18): CPU time per step at most 1.05x DDP's at stage 2, 1.15x at stage 3; one round of a few steps is
noisy on a shared machine.

Raw readings of this run: `{_short(str(Path(args["out_dir"]) / "report.json"))}` (not committed); `bench/report
--from_json` with it renders this page again.
"""  # fmt: skip
    results.write_text(text)


def _short(part: str) -> str:
    """A path inside the repository as relative to it, anything else as it is."""
    return os.path.relpath(part, REPO) if part.startswith(str(REPO)) else part
