"""Writes bench/RESULTS.md and its PNG plots from the readings run_report.py collected (its report.json).

The estimate beside each measured memory number is `accelerate_zero.debug.estimate.estimate_stage` for the same
model (harness/models.py `build_model` at the run's size), the same config (`models.engine_config`), world size and
rank: the engine's own layout code, not a formula.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import engine_bench
import report_plots
import report_sections as sections
import stage3_bench
from harness.models import build_model, engine_config
from harness.peers import PEERS
from harness.summary import Summary, summarize
from sweep_worker import LLAMA, build_llama


REPO = Path(__file__).resolve().parents[1]


def estimates_for(
    sweep: dict[int, list[dict[str, Any]]], hidden: int, layers: int, model: str = "linear"
) -> dict[tuple[int, int, int], dict[str, int]]:
    """`estimate_stage(...).device` for every (stage, world size, rank) the sweep measured on `model`."""
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug.estimate import TrainingSetup, estimate_stage, shapes_from_module

    key, params_key = ("llama_stages", "llama_params") if model == "llama" else ("stages", "params")
    out = {}
    for world_size, ranks in sweep.items():
        for stage_key in ranks[0].get(key, {}):
            stage = int(stage_key)
            zero = ZeroConfig.from_any(engine_config(stage, None)).zero_optimization
            module = build_llama("meta") if model == "llama" else build_model(hidden, layers)
            shapes = shapes_from_module(module, zero)
            if shapes.numel != ranks[0][params_key]:
                raise ValueError(
                    f"the estimate's {model} has {shapes.numel=} parameters, the run {ranks[0][params_key]}"
                )
            setup = TrainingSetup(world_size, "no", "adamw", zero=zero)
            for rank in range(world_size):
                out[(stage, world_size, rank)] = dict(estimate_stage(shapes, setup, stage, rank=rank).device)
    return out


def _llama_text(rows: list[sections.SweepRow]) -> str:
    if not rows:
        return " (the Llama was not measured in this run)"
    worlds = ", ".join(str(w) for w in sorted({r.world_size for r in rows}))
    return (
        f", and for a LlamaForCausalLM shaped like `offload_bench.py`'s largest-model ladder "
        f"({LLAMA['num_hidden_layers']} decoder layers, hidden {LLAMA['hidden_size']}, intermediate "
        f"{LLAMA['intermediate_size']}, vocabulary {LLAMA['vocab_size']}: Ψ = {rows[0].params:,}; at stage 3 its "
        f"decoder layers are the gather units) at W = {worlds}, measured by `sweep_worker.py --llama`"
    )


def _short(part: str) -> str:
    """A path inside the repository as relative to it (command lines in RESULTS.md), anything else as it is."""
    return os.path.relpath(part, REPO) if part.startswith(str(REPO)) else part


def _offload_json_tables(data: Any) -> str:
    """offload_bench.py's JSON keeps its tables under "markdown"; anything else is shown as well as it can be."""
    if isinstance(data, dict) and isinstance(data.get("markdown"), str):
        return data["markdown"].strip()
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return sections.json_records_table(data)
    records = next((v for v in data.values() if isinstance(v, list)), None) if isinstance(data, dict) else None
    return sections.json_records_table(records) if records else "```json\n" + json.dumps(data)[:3000] + "\n```"


def _offload_section(offload: dict[str, Any]) -> str:
    status = offload["status"]
    if status == "absent":
        return "Not run: `bench/offload_bench.py` did not exist when this report ran."
    if status == "no_json":
        return "Not run: `--skip_offload_run` was given and `bench/out/offload.json` does not exist."
    if status == "json":
        head = "Read from `bench/out/offload.json` (an earlier `bench/offload_bench.py` run; `--skip_offload_run`):"
        return head + "\n\n" + _offload_json_tables(offload["json"])
    command = " ".join(["python", *(_short(part) for part in offload["command"][1:])])
    if offload.get("json"):
        tables = _offload_json_tables(offload["json"])
    else:
        tables = sections.markdown_tables(offload.get("stdout", ""))
    out = f"`{command}`, run by the report in {offload.get('seconds', 0):.0f} s: {status}."
    if offload.get("tracked") is False:
        out += " (`bench/offload_bench.py` was not committed yet: the report ran the working tree's version.)"
    tail = "\n".join(offload.get("stderr_tail", []))
    if status != "ran" and tail.strip():
        out += f" The end of its log (`bench/out/report/offload.log`):\n\n```\n{tail}\n```"
    out += "\n\n" + tables if tables else "\n\nIt printed no markdown table."
    saved = offload.get("saved_full_run")
    if saved:
        out += (
            "\n\nThe largest-model part takes longer than this report's budget. The last full run of "
            f"`python bench/offload_bench.py` (`bench/out/offload.json`, written {saved['written']}, not by this "
            "report) found:\n\n" + _offload_json_tables(saved["json"])
        )
    else:
        out += (
            "\n\nThe largest-model part (the largest model DDP, stage 3 and stage 3 + offload train within the RAM) "
            "takes longer than this report's budget, and no saved full run (`bench/out/offload.json`) exists to "
            "show: `python bench/offload_bench.py --part largest` runs it."
        )
    return out


def _target_note(summaries: list[Summary]) -> str:
    """The memory targets were set at Ψ = 16.8M; RSS carries a fixed non-tensor part that weighs more when Ψ is smaller."""
    torch_side = [s.rss_mb - s.live_tensor_mb for s in summaries if not s.system.startswith("ds")]
    if not torch_side:
        return ""
    return (
        f"\nThe memory targets were set for the 16.8M-parameter model of `engine_bench.py` / `stage3_bench.py`. RSS "
        f"minus live tensors is {min(torch_side):.0f}-{max(torch_side):.0f} MB for every torch and accelerate_zero "
        "system here (gloo, the allocator, code): a fixed part that weighs more at this run's Ψ. The live "
        "tensors, which the memory table compares with the formula, have no such part."
    )


def _memory_notes(summaries: list[Summary]) -> str:
    """Says why a system's live tensors exceed its RSS by far (allocated pages never touched)."""
    notes = []
    for s in summaries:
        if s.live_tensor_mb > 2 * s.rss_mb:
            why = (
                " DeepSpeed stage 3 allocates its contiguous-gradients bucket up front as `torch.empty` of "
                "reduce_bucket_size (5e8) fp32 elements = 2,000 MB; only the pages it writes become resident."
                if s.system == "ds3"
                else ""
            )
            notes.append(
                f"{PEERS[s.system].label}: its live tensors ({s.live_tensor_mb:,.0f} MB) exceed its RSS "
                f"({s.rss_mb:,.0f} MB): RSS does not count allocated pages that were never written.{why}"
            )
    return "".join(f"\n\n{note}" for note in notes)


def _machine_lines(payload: dict[str, Any], summaries: list[Summary]) -> str:
    m = payload["machine"]
    world_size = summaries[0].world_size if summaries else 0
    readings = [value for s in summaries for pair in s.loadavg_1min if pair for value in pair]
    peak = f", {max(readings):.1f} at its highest between systems" if readings else ""
    v = m["versions"]
    ds = payload.get("deepspeed_version")
    dirty = m["uncommitted_engine_files"]
    lines = [
        f"- Started {m['date']}; the runs took {payload['seconds']['total'] / 60:.1f} minutes "
        f"(memory sweep {payload['seconds']['sweep'] / 60:.1f}, systems {payload['seconds']['systems'] / 60:.1f}, "
        f"offload {payload['seconds']['offload'] / 60:.1f}, Trainer {payload['seconds'].get('trainer', 0) / 60:.1f}).",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, CPU only, gloo. "
        f"Python {m['python']}, torch {v['torch']}, transformers {v['transformers']}, accelerate {v['accelerate']}"
        + (f", DeepSpeed {ds} (its own virtualenv)" if ds else "")
        + ".",
        f"- Code: commit {m['commit']}"
        + (
            f", with uncommitted changes by other engineers in {len(dirty)} engine file(s) ({', '.join(dirty)})"
            if dirty
            else ""
        )
        + ".",
        f"- **Timing is on a {m['cores']}-core machine**: "
        + (
            "other jobs were running during this run "
            if payload["load_start"]["loadavg"][0] >= 1.0
            else "the machine was otherwise idle when the run started "
        )
        + f"(1-minute load average {payload['load_start']['loadavg'][0]:.1f} at the start, "
        f"{payload['load_end']['loadavg'][0]:.1f} at the end{peak}), and {world_size} ranks share the {m['cores']} cores. Step times are "
        "only meaningful as ratios to DDP in the same run; absolute milliseconds are not.",
    ]
    return "\n".join(lines)


def write(payload: dict[str, Any], results: Path, plots_dir: Path) -> None:
    """Renders RESULTS.md at `results` and the PNGs into `plots_dir`."""
    args = payload["args"]
    hidden, layers = int(args["hidden"]), int(args["layers"])
    sweep = {int(w): ranks for w, ranks in payload["sweep"].items() if ranks}
    from_systems = sections.sweep_from_systems(payload["main"])
    if from_systems and from_systems[0]["world_size"] not in sweep:
        sweep[from_systems[0]["world_size"]] = from_systems
    summaries = [summarize(system, rounds) for system, rounds in payload["main"].items() if rounds]
    by_name = {s.system: s for s in summaries}
    ddp = by_name.get("ddp")
    for s in summaries:
        if s.system.startswith("ds"):
            rank0 = payload["main"][s.system][0][0]
            payload["deepspeed_version"] = rank0["extra"].get("deepspeed_version")
    rows = sections.sweep_rows(sweep, estimates_for(sweep, hidden, layers))
    llama_rows = sections.sweep_rows(sweep, estimates_for(sweep, hidden, layers, "llama"), "llama")
    honesty, honest = sections.honesty_table(rows + llama_rows)
    plots_dir.mkdir(parents=True, exist_ok=True)
    world = summaries[0].world_size if summaries else 0
    memory_png, comparison_png = plots_dir / "memory_vs_world_size.png", plots_dir / f"systems_w{world}.png"
    params = rows[0].params if rows else (summaries[0].params if summaries else 0)
    model = f"{layers} x Linear({hidden}, {hidden}), Ψ = {params:,} fp32 parameters, AdamW"
    report_plots.memory_vs_world_size(sections.plot_series(rows), memory_png, model)
    if summaries:
        report_plots.comparison(summaries, comparison_png, f"W = {world} processes on 2 shared cores; {model}")
    link = lambda path: os.path.relpath(path, results.parent)  # noqa: E731
    checks = [c.line() for c in engine_bench.checks(by_name)] + stage3_bench.training_checks(by_name)
    spread = sections.step_ratio_spread(summaries)
    first = summaries[0] if summaries else None
    notes = payload.get("notes", []) + [
        f"{s} failed: see its log in bench/out/report/." for s in payload.get("failed", [])
    ]
    raw = _short(str(Path(args["out_dir"]) / "report.json"))
    text = f"""# Benchmark results

Written by `bench/report` (see [README.md](README.md#benchmark-report)); regenerate with the same command. MB =
10^6 bytes. Model: {model}, one fixed random batch of 8 per rank, MSE loss, gradient clipping off; every system
trains the same model on the same data (the final losses agree).

{_machine_lines(payload, summaries)}
{"".join(f"{chr(10)}- {note}" for note in notes)}

## Memory per rank, W = {first.world_size if first else "—"}

Max over ranks at the end of the run. Engine-held is `engine.memory_breakdown()["total"]` (accelerate_zero only);
live tensors are every tensor the garbage collector sees, each storage once (memory held only by C++ code is
missed); RSS is the process's resident memory above its reading before the model existed (it includes allocator
slack, communication library buffers and pages of code loaded since). ZeRO formula for fp32 Adam: DDP 16Ψ, stage 1 8Ψ+8Ψ/W, stage 2
4Ψ+12Ψ/W, stage 3 16Ψ/W bytes.

{sections.memory_table(summaries)}{_memory_notes(summaries)}

![memory per rank and step time of every system]({link(comparison_png)})

## Bytes moved and step time, W = {first.world_size if first else "—"}

Bytes per step per rank are each system's own count with the ring convention (all-reduce 2N(W−1)/W,
reduce-scatter and all-gather N(W−1)/W, broadcast N); wire bytes are what each process wrote to its sockets
(`wchar`). Step time: `dist.barrier()`, then forward + backward + optimizer step; a step counts as its slowest
rank; median over {first.steps if first else "—"} timed steps after {args["warmup"]} warm-up steps, one thread per
rank. DDP ran first and again last (its two medians are "by round"; the table's DDP median pools both){
        f": they are {100 * (spread - 1):.0f}% apart, the noise floor of every ratio below" if spread else ""
    }.

{sections.traffic_time_table(summaries, ddp)}

Targets of the engine (issue 2) and stage 3 (issue 3) benchmarks, on this run:

{chr(10).join(f"- {line}" for line in checks)}
{_target_note(summaries)}

## Memory per rank against world size: measured and estimated

`sweep_worker.py` runs stages 0-3 at W = {", ".join(str(w) for w in sorted(sweep))} and reads, after one optimizer
step, `engine.memory_breakdown()` and the live tensors of each rank{
        f" (the W = {world} point is the comparison's own stage 0-3 runs above, read after their timed steps; its RSS "
        "includes the process's fixed non-tensor part, which the sweep's warm-up run absorbs at the other world sizes)"
        if from_systems and world in sweep and sweep[world] is from_systems
        else ""
    }; the estimate is
`accelerate_zero.debug.estimate.estimate_stage` (what `accelerate-zero estimate` prints) for the same model, config,
world size and rank. The estimated total adds the transient buffers the estimate bounds (stage 2 reduce bucket,
stage 3 gathered units and gradient buffers); `memory_breakdown()` total counts the buffers alive when it is read.

![memory per rank against world size]({link(memory_png)})

{sections.sweep_table(rows)}

## Is the estimate honest?

For the models the benchmarks train: the estimate of model-state bytes per rank (parameters, gradients, master
weights, optimizer states) against `memory_breakdown()`, every rank, for the Linear stack at every stage and world
size above{_llama_text(llama_rows)}. **{"PASS" if honest else "FAIL"}: {
        "every" if honest else "not every"
    } estimate is within
{sections.HONESTY_TOLERANCE:.0%} of what the engine holds.**

{honesty}

## Offload

{_offload_section(payload["offload"])}

## The transformers Trainer: DDP, accelerate_zero and DeepSpeed

{sections.trainer_section(payload.get("trainer"))}

## How each number is measured

See [README.md](README.md) ("How each number is measured") and `harness/readings.py`, [Note: how the benchmark
measures]. Raw readings of this run: `{raw}` (not committed); `bench/report --from_json {raw}`
renders this page again from them.
"""
    results.write_text(text)
