"""Turns the workers' raw measurements into per-system summaries, the markdown tables and the target checks.

Pure Python (no torch): every number here is computed from the JSON the workers wrote. MB means 10**6 bytes.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any


MB = 1e6
BYTES_FP32 = 4

# ZeRO paper memory per rank for fp32 Adam, in bytes per parameter: (replicated, divided by W).
# fp32 training keeps no separate master copy: parameters 4, gradients 4, Adam's two moments 8.
MEMORY_FORMULA = {
    "ddp": (16, 0),
    "ddp_bucket_view": (16, 0),
    "ddp_zero_r": (8, 8),
    "az0": (16, 0),
    "az1": (8, 8),
    "az2": (4, 12),
    "ds1": (8, 8),
    "ds2": (4, 12),
    "az3": (0, 16),
    "fsdp2": (0, 16),
    "ds3": (0, 16),
}
FORMULA_TEXT = {(16, 0): "16Ψ", (8, 8): "8Ψ+8Ψ/W", (4, 12): "4Ψ+12Ψ/W", (0, 16): "16Ψ/W"}

LABELS = {
    "ddp": "torch DDP + AdamW",
    "ddp_bucket_view": "torch DDP (gradient_as_bucket_view) + AdamW",
    "ddp_zero_r": "torch DDP + ZeroRedundancyOptimizer(AdamW)",
    "az0": "accelerate_zero stage 0",
    "az1": "accelerate_zero stage 1",
    "az2": "accelerate_zero stage 2",
    "ds1": "DeepSpeed 0.19 stage 1",
    "ds2": "DeepSpeed 0.19 stage 2",
    "az3": "accelerate_zero stage 3",
    "fsdp2": "torch FSDP2 (fully_shard per Linear)",
    "ds3": "DeepSpeed 0.19 stage 3",
}
COUNTED_BY = {
    "ddp": "comm hook",
    "ddp_bucket_view": "comm hook",
    "ddp_zero_r": "comm hook + wrapped dist.broadcast",
    "az0": "engine.comm_stats()",
    "az1": "engine.comm_stats()",
    "az2": "engine.comm_stats()",
    "ds1": "DeepSpeed comms logger",
    "ds2": "DeepSpeed comms logger",
    "az3": "engine.comm_stats()",
    "fsdp2": "wrapped dist.all_gather_single / reduce_scatter_single",
    "ds3": "DeepSpeed comms logger",
}


@dataclass
class Summary:
    """One system's numbers: memory is the max over ranks, time the median over steps of the slowest rank.

    With several rounds, memory and bytes come from the first round and the step times pool all rounds.
    """

    system: str
    world_size: int
    params: int
    steps: int
    rounds: int
    rss_mb: float
    anon_rss_mb: float
    peak_rss_mb: float | None
    live_tensor_mb: float
    held_mb: float | None
    memory_formula_mb: float
    comm_mb_per_step: float
    wire_mb_per_step: float
    comm_formula_mb: float
    step_ms: float
    step_ms_p25_p75: tuple[float, float]
    step_ms_by_round: list[float]
    cpu_ms_per_rank: float
    minor_faults_per_step: float | None
    loadavg_1min: list[list[float] | None]
    final_loss: float
    comm_by_kind: dict[str, Any]
    memory_breakdown: dict[str, int] | None


def memory_formula_bytes(system: str, params: int, world_size: int) -> float:
    replicated, sharded = MEMORY_FORMULA[system]
    return params * (replicated + sharded / world_size)


def comm_formula_bytes(params: int, world_size: int) -> float:
    """2Ψ(W-1)/W elements of 4 bytes: one all-reduce of the gradients, or a reduce-scatter plus an all-gather."""
    return 2 * params * (world_size - 1) / world_size * BYTES_FP32


def summarize(system: str, rounds: list[list[dict[str, Any]]]) -> Summary:
    """Combines every rank's raw measurement (bench_common.Measurement as a dict) into one Summary.

    Memory, bytes and loss come from the first round (they repeat exactly); step times pool every round.
    """
    ranks = rounds[0]
    first = ranks[0]
    world_size, params, steps = first["world_size"], first["params"], len(first["step_seconds"])
    rss = max(r["after"]["VmRSS"] - r["baseline"]["VmRSS"] for r in ranks)
    anon = max(r["after"]["RssAnon"] - r["baseline"]["RssAnon"] for r in ranks)
    peak = max(r["after"]["VmHWM"] - r["baseline"]["VmRSS"] for r in ranks) if first["peak_reset"] else None
    breakdowns = [r["extra"].get("memory_breakdown") for r in ranks]
    held = max(b["total"] for b in breakdowns) if breakdowns[0] else None
    slowest_by_round = [_slowest_rank_per_step(round_ranks) for round_ranks in rounds]
    slowest = [seconds for round_slowest in slowest_by_round for seconds in round_slowest]
    quartiles = statistics.quantiles(slowest, n=4)
    return Summary(
        system=system,
        world_size=world_size,
        params=params,
        steps=steps,
        rounds=len(rounds),
        rss_mb=rss / MB,
        anon_rss_mb=anon / MB,
        peak_rss_mb=None if peak is None else peak / MB,
        live_tensor_mb=max(r["live_tensor_bytes"] for r in ranks) / MB,
        held_mb=None if held is None else held / MB,
        memory_formula_mb=memory_formula_bytes(system, params, world_size) / MB,
        comm_mb_per_step=max(r["comm"]["total"]["bytes_per_rank"] for r in ranks) / steps / MB,
        wire_mb_per_step=max(sum(r["wire_bytes_per_step"]) for r in ranks) / steps / MB,
        comm_formula_mb=comm_formula_bytes(params, world_size) / MB,
        step_ms=1000 * statistics.median(slowest),
        step_ms_p25_p75=(1000 * quartiles[0], 1000 * quartiles[2]),
        step_ms_by_round=[1000 * statistics.median(round_slowest) for round_slowest in slowest_by_round],
        cpu_ms_per_rank=1000 * statistics.median(_pooled(rounds, "step_cpu_seconds")),
        minor_faults_per_step=_median_or_none(_pooled(rounds, "step_minor_faults")),
        loadavg_1min=[r[0]["extra"].get("loadavg_1min") for r in rounds],
        final_loss=statistics.fmean(r["losses"][-1] for r in ranks),
        comm_by_kind=first["comm"],
        memory_breakdown=breakdowns[0],
    )


def _slowest_rank_per_step(ranks: list[dict[str, Any]]) -> list[float]:
    return [max(times) for times in zip(*(r["step_seconds"] for r in ranks), strict=True)]


def _pooled(rounds: list[list[dict[str, Any]]], key: str) -> list[float]:
    """Every rank's per-step values of `key`, over every round (none when an older run did not record it)."""
    return [value for ranks in rounds for rank in ranks for value in rank.get(key, [])]


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None, reference: float | None) -> str:
    return "—" if value is None or not reference else f"{value / reference:.2f}"


def main_table(summaries: list[Summary], reference: Summary | None) -> str:
    """The headline table: memory, bytes and time against the ZeRO formulas and against DDP."""
    rows = [
        "| system | RSS per rank (MB, max over ranks) | anonymous RSS (MB) | engine-held (MB) | ZeRO formula (MB) | "
        "RSS / formula | held / formula | bytes per step per rank (MB) | formula 2Ψ(W−1)/W·4 (MB) | "
        "bytes / formula | step time (ms, median) | step time / DDP |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        formula = FORMULA_TEXT[MEMORY_FORMULA[s.system]]
        rows.append(
            f"| {LABELS[s.system]} | {_fmt(s.rss_mb)} | {_fmt(s.anon_rss_mb)} | {_fmt(s.held_mb)} | "
            f"{formula} = {_fmt(s.memory_formula_mb)} | "
            f"{_ratio(s.rss_mb, s.memory_formula_mb)} | {_ratio(s.held_mb, s.memory_formula_mb)} | "
            f"{_fmt(s.comm_mb_per_step)} ({COUNTED_BY[s.system]}) | {_fmt(s.comm_formula_mb)} | "
            f"{_ratio(s.comm_mb_per_step, s.comm_formula_mb)} | {_fmt(s.step_ms, 0)} | "
            f"{_ratio(s.step_ms, reference.step_ms if reference else None)} |"
        )
    return "\n".join(rows)


def crosscheck_table(summaries: list[Summary]) -> str:
    """Independent readings: peak RSS, tensors the GC sees, bytes really written to gloo's sockets, the loss."""
    rows = [
        "| system | peak RSS (MB) | live tensors (MB) | anonymous RSS − live tensors (MB) | "
        "wire bytes per step per rank (MB) | wire / formula | counted / wire | step ms p25–p75 | "
        "step ms median by round | CPU ms per step per rank | page faults per step | load avg before → after | "
        "final loss (mean over ranks) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    for s in summaries:
        by_round = " / ".join(f"{ms:.0f}" for ms in s.step_ms_by_round)
        load = " / ".join("—" if pair is None else f"{pair[0]:.1f} → {pair[1]:.1f}" for pair in s.loadavg_1min)
        rows.append(
            f"| {LABELS[s.system]} | {_fmt(s.peak_rss_mb)} | {_fmt(s.live_tensor_mb)} | "
            f"{_fmt(s.anon_rss_mb - s.live_tensor_mb)} | {_fmt(s.wire_mb_per_step)} | "
            f"{_ratio(s.wire_mb_per_step, s.comm_formula_mb)} | {_ratio(s.comm_mb_per_step, s.wire_mb_per_step)} | "
            f"{s.step_ms_p25_p75[0]:.0f}–{s.step_ms_p25_p75[1]:.0f} | {by_round} | {s.cpu_ms_per_rank:.0f} | "
            f"{_fmt(s.minor_faults_per_step, 0)} | {load} | "
            f"{s.final_loss:.7f} |"
        )
    return "\n".join(rows)


def comm_kind_table(summaries: list[Summary]) -> str:
    """Per collective kind, as each system counted it (per step per rank)."""
    rows = [
        "| system | kind | calls per step | payload per step (MB) | bytes per step per rank (MB) |",
        "|---|---|--:|--:|--:|",
    ]
    for s in summaries:
        for kind, entry in s.comm_by_kind.items():
            if kind == "total":
                continue
            rows.append(
                f"| {LABELS[s.system]} | {kind} | {entry['calls'] / s.steps:g} | "
                f"{entry['payload_bytes'] / s.steps / MB:,.2f} | {entry['bytes_per_rank'] / s.steps / MB:,.2f} |"
            )
    return "\n".join(rows)


@dataclass
class Check:
    name: str
    passed: bool | None
    detail: str

    def line(self) -> str:
        verdict = "SKIP" if self.passed is None else ("PASS" if self.passed else "FAIL")
        return f"{verdict}  {self.name}: {self.detail}"


def checks(by_name: dict[str, Summary]) -> list[Check]:
    """The lead's targets, each PASS/FAIL (SKIP when a system it needs did not run)."""
    out = []
    az1, zero_r, az2, ddp = (by_name.get(k) for k in ("az1", "ddp_zero_r", "az2", "ddp"))
    out.append(_memory_check("stage 1 RSS <= ZeroRedundancyOptimizer RSS", az1, zero_r, 1.0))
    out.append(_memory_check("stage 2 RSS <= 0.5 x DDP RSS", az2, ddp, 0.5))
    for stage in range(3):
        s = by_name.get(f"az{stage}")
        name = f"stage {stage} bytes per step within 5% of 2Ψ(W−1)/W·4"
        if s is None:
            out.append(Check(name, None, f"az{stage} missing"))
            continue
        ratio = s.comm_mb_per_step / s.comm_formula_mb
        detail = f"comm_stats {s.comm_mb_per_step:.2f} MB vs {s.comm_formula_mb:.2f} MB (ratio {ratio:.3f})"
        out.append(Check(name, abs(ratio - 1) <= 0.05, detail))
    out.append(_ratio_check("stage 2 step time <= 1.15 x DDP", az2, ddp, "step_ms", 1.15, "ms"))
    return out


def wire_checks(by_name: dict[str, Summary]) -> list[Check]:
    """Not a target: the same 5% test on the bytes really written to the sockets (gloo's own algorithms)."""
    out = []
    for system in ("az0", "az1", "az2"):
        s = by_name.get(system)
        if s is not None:
            ratio = s.wire_mb_per_step / s.comm_formula_mb
            detail = f"wire {s.wire_mb_per_step:.2f} MB vs {s.comm_formula_mb:.2f} MB (ratio {ratio:.3f})"
            out.append(
                Check(f"(info) stage {system[-1]} wire bytes within 5% of formula", abs(ratio - 1) <= 0.05, detail)
            )
    return out


def _memory_check(name: str, s: Summary | None, ref: Summary | None, limit: float) -> Check:
    """Passes only when both the process RSS and its anonymous part are within `limit` x the reference's.

    File-backed pages (shared libraries) count in RSS but the kernel may drop them under memory pressure from
    other processes; the anonymous part cannot be dropped without swap, so it is the steadier reading.
    """
    if s is None or ref is None:
        return Check(name, None, "a system it compares did not run")
    rss, anon = s.rss_mb / ref.rss_mb, s.anon_rss_mb / ref.anon_rss_mb
    detail = (
        f"RSS {s.rss_mb:.1f} MB vs {ref.rss_mb:.1f} MB (ratio {rss:.2f}); anonymous {s.anon_rss_mb:.1f} MB vs "
        f"{ref.anon_rss_mb:.1f} MB (ratio {anon:.2f}); limit {limit}"
    )
    return Check(name, rss <= limit and anon <= limit, detail)


def _ratio_check(name: str, s: Summary | None, ref: Summary | None, attr: str, limit: float, unit: str) -> Check:
    if s is None or ref is None:
        return Check(name, None, "a system it compares did not run")
    value, reference = getattr(s, attr), getattr(ref, attr)
    ratio = value / reference
    return Check(
        name, ratio <= limit, f"{value:.1f} {unit} vs {reference:.1f} {unit} (ratio {ratio:.2f}, limit {limit})"
    )


def as_json(summaries: list[Summary], check_list: list[Check]) -> dict[str, Any]:
    return {
        "summaries": [asdict(s) for s in summaries],
        "checks": [asdict(c) for c in check_list],
    }
