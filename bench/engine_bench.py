"""Memory, bytes moved and step time of accelerate_zero stages 0-3 against DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed on the Linear stack (bench/README.md, "engine_bench.py").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from harness import cli, launch, report
from harness.peers import FORMULA_TEXT, PEERS
from harness.report import Check, fmt, ratio
from harness.steps import launch_train, runnable
from harness.summary import MB, STAGE3_SYSTEMS, Summary, summarize


SYSTEMS = ("ddp", "ddp_bucket_view", "ddp_zero_r", "az0", "az1", "az2", "ds1", "ds2")


def main_table(summaries: list[Summary], ddp: Summary | None, fsdp2: Summary | None) -> str:
    """The headline table: memory, bytes and time against the ZeRO formulas, DDP and FSDP2."""
    columns = [
        "system", "RSS per rank (MB, max over ranks)", "anonymous RSS (MB)", "engine-held (MB)", "ZeRO formula (MB)",
        "RSS / formula", "held / formula", "bytes per step per rank (MB)", "formula (MB)", "bytes / formula",
        "step time (ms, median)", "step time / DDP", "step time / FSDP2",
    ]  # fmt: skip
    rows = [
        (PEERS[s.system].label, fmt(s.rss_mb), fmt(s.anon_rss_mb), fmt(s.held_mb),
         f"{FORMULA_TEXT[PEERS[s.system].memory]} = {fmt(s.memory_formula_mb)}", ratio(s.rss_mb, s.memory_formula_mb),
         ratio(s.held_mb, s.memory_formula_mb), f"{fmt(s.comm_mb_per_step)} ({PEERS[s.system].counted_by})",
         f"{3 if s.system in STAGE3_SYSTEMS else 2}Ψ(W−1)/W·4 = {fmt(s.comm_formula_mb)}",
         ratio(s.comm_mb_per_step, s.comm_formula_mb), fmt(s.step_ms, 0),
         ratio(s.step_ms, ddp and ddp.step_ms), ratio(s.step_ms, fsdp2 and fsdp2.step_ms))
        for s in summaries
    ]  # fmt: skip
    return report.table(columns, rows)


def crosscheck_table(summaries: list[Summary]) -> str:
    """Independent readings: peak RSS, tensors the GC sees, bytes really written to gloo's sockets, the loss."""
    columns = [
        "system", "peak RSS (MB)", "live tensors (MB)", "anonymous RSS − live tensors (MB)",
        "wire bytes per step per rank (MB)", "wire / formula", "counted / wire", "step ms p25–p75",
        "step ms median by round", "CPU ms per step per rank", "page faults per step", "load avg before → after",
        "final loss (mean over ranks)",
    ]  # fmt: skip
    rows = [
        (PEERS[s.system].label, fmt(s.peak_rss_mb), fmt(s.live_tensor_mb), fmt(s.anon_rss_mb - s.live_tensor_mb),
         fmt(s.wire_mb_per_step), ratio(s.wire_mb_per_step, s.comm_formula_mb),
         ratio(s.comm_mb_per_step, s.wire_mb_per_step), f"{s.step_ms_p25_p75[0]:.0f}–{s.step_ms_p25_p75[1]:.0f}",
         " / ".join(f"{ms:.0f}" for ms in s.step_ms_by_round), f"{s.cpu_ms_per_rank:.0f}",
         fmt(s.minor_faults_per_step, 0),
         " / ".join("—" if pair is None else f"{pair[0]:.1f} → {pair[1]:.1f}" for pair in s.loadavg_1min),
         f"{s.final_loss:.7f}")
        for s in summaries
    ]  # fmt: skip
    return report.table(columns, rows, "l" + "r" * 7 + "l" + "r" * 4)


def breakdown_table(summaries: list[Summary]) -> str:
    """`engine.memory_breakdown()` of rank 0, ours only."""
    held = [s for s in summaries if s.memory_breakdown]
    keys = [k for k in held[0].memory_breakdown if k != "total"] + ["total"] if held else []
    rows = [(s.system, *(f"{s.memory_breakdown.get(k, 0) / MB:.2f}" for k in keys)) for s in held]
    return report.table(["system", *keys], rows)


def checks(by: dict[str, Summary]) -> list[Check]:
    """The targets of issues 2 (stages 0-2) and 3 (stage 3), SKIP when a system they need did not run; then the
    same 5% test on the wire bytes (information: gloo chooses its own algorithms)."""
    out = [_memory_check("stage 1 RSS <= ZeroRedundancyOptimizer RSS", by, "az1", "ddp_zero_r", 1.0),
           _memory_check("stage 2 RSS <= 0.5 x DDP RSS", by, "az2", "ddp", 0.5),
           _memory_check("stage 3 RSS <= 0.45 x DDP RSS", by, "az3", "ddp", 0.45),
           _memory_check("stage 3 RSS <= FSDP2 RSS", by, "az3", "fsdp2", 1.0)]  # fmt: skip
    for stage, reading in [(stage, "counted") for stage in range(4)] + [(s, "wire") for s in range(3)]:
        s = by.get(f"az{stage}")
        name = f"stage {stage} {reading} bytes per step within 5% of the formula"
        if s is None:
            out += [] if reading == "wire" else [Check(name, None, f"az{stage} did not run")]
            continue
        value = (s.comm_mb_per_step if reading == "counted" else s.wire_mb_per_step) / s.comm_formula_mb
        detail = f"{value * s.comm_formula_mb:.2f} MB vs {s.comm_formula_mb:.2f} MB (ratio {value:.3f})"
        if reading == "counted" and stage == 3:
            detail += " by kind: " + ", ".join(f"{k} {v['bytes_per_rank'] / s.steps / MB:.1f}"
                                               for k, v in s.comm_by_kind.items() if k != "total")  # fmt: skip
        out.append(Check(name if reading == "counted" else f"(info) {name}", abs(value - 1) <= 0.05, detail))
    time = lambda system: by[system].step_ms if system in by else None  # noqa: E731
    out.append(report.at_most("stage 2 step time <= 1.15 x DDP", time("az2"), time("ddp"), 1.15, " ms"))
    out.append(report.at_most("stage 3 step time <= 1.1 x FSDP2", time("az3"), time("fsdp2"), 1.1, " ms"))
    out.append(report.at_most("stage 3 step time below DeepSpeed stage 3", time("az3"), time("ds3"), 1.0, " ms"))
    return out


def _memory_check(name: str, by: dict[str, Summary], system: str, reference: str, limit: float) -> Check:
    """Passes only when both the process RSS and its anonymous part are within `limit` x the reference's: the
    kernel may drop file-backed pages under other processes' pressure, not anonymous ones (no swap)."""
    s, ref = by.get(system), by.get(reference)
    if s is None or ref is None:
        return Check(name, None, "a system it compares did not run")
    rss, anon = s.rss_mb / ref.rss_mb, s.anon_rss_mb / ref.anon_rss_mb
    detail = (f"RSS {s.rss_mb:.1f} MB vs {ref.rss_mb:.1f} MB (ratio {rss:.2f}); anonymous {s.anon_rss_mb:.1f} MB vs "
              f"{ref.anon_rss_mb:.1f} MB (ratio {anon:.2f}); limit {limit}")  # fmt: skip
    return Check(name, rss <= limit and anon <= limit, detail)


def answer_text(summaries: list[Summary]) -> str:
    """Every table and check of one run."""
    by = {s.system: s for s in summaries}
    first = summaries[0]
    return "\n\n".join([
        f"Ψ = {first.params:,} parameters, W = {first.world_size}, {first.steps} timed steps x {first.rounds} "
        "round(s); MB = 10^6 bytes", main_table(summaries, by.get("ddp"), by.get("fsdp2")),
        "Cross-checks", crosscheck_table(summaries), "engine.memory_breakdown() on rank 0 (MB)",
        breakdown_table(summaries), "Collectives as each system counted them", report.comm_kind_table(summaries),
        "\n".join(check.line() for check in checks(by)),
    ])  # fmt: skip


def engine_bench(
    world_size: int = 4,
    steps: int = 20,
    warmup: int = 3,
    rounds: int = 1,
    systems: tuple[str, ...] = SYSTEMS,
    reduce_bucket_size: int | None = None,
    ds_venv: Path = launch.DEFAULT_DS_VENV,
) -> cli.Answer:
    """Each system trains the Linear stack in its own fresh group (`steps.train`); DeepSpeed from its virtualenv.

    Args:
        world_size: processes per system.
        steps: timed steps per system (at least 10: medians).
        warmup: untimed steps before them.
        rounds: run the list this many times, every other round reversed; step times pool the rounds.
        systems: peers of harness/peers.py.
        reduce_bucket_size: zero_optimization.reduce_bucket_size (default: each engine's own).
        ds_venv: DeepSpeed's own virtualenv.
    """
    if steps < 10 or world_size < 2:
        raise SystemExit(f"--steps {steps} (at least 10: medians), --world_size {world_size} (at least 2: shards)")
    names = runnable(list(systems), ds_venv)
    raw: dict[str, list[list[dict[str, Any]]]] = {system: [] for system in names}
    for round_index, system in launch.interleaved(names, rounds):
        ranks = launch_train(system, world_size, out_dir=launch.BENCH_DIR / "out" / "engine_bench", ds_venv=ds_venv,
                             round_index=round_index, steps=steps, warmup=warmup,
                             reduce_bucket_size=reduce_bucket_size)  # fmt: skip
        raw[system] += [ranks] if ranks is not None else []
    summaries = [summarize(system, done) for system, done in raw.items() if done]
    failed = [system for system, done in raw.items() if len(done) < rounds]
    text = answer_text(summaries) if summaries else "no system finished"
    text += f"\n\nthese systems failed (their logs: bench/out/engine_bench/): {', '.join(failed)}" if failed else ""
    title = f"engine_bench: {', '.join(names)} on the Linear stack, W = {world_size}"
    return cli.Answer(title, text, {"raw": raw, "summaries": [vars(s) for s in summaries]}, not failed)


if __name__ == "__main__":
    sys.exit(cli.main(engine_bench, choices={"systems": list(PEERS)}))
