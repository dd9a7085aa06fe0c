"""The sections of bench/RESULTS.md and the data behind its plots, from the numbers run_report.py collected.

Pure Python (no torch, no matplotlib): tests/unit/test_bench_report.py feeds it made-up readings. MB means 10**6
bytes. The per-system summaries come from harness/summary.py; the memory sweep readings are what run_report.py's
`sweep` measured, beside `accelerate_zero.debug.estimate`'s numbers for the same rank, stage and world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness import report, summary
from harness.peers import FORMULA_TEXT, PEERS


MB = summary.MB
MODEL_STATE_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")
HONESTY_TOLERANCE = 0.10
"""The estimate of model-state bytes per rank must be within 10% of `memory_breakdown()` (issue 8)."""
SWEEP_LLAMA_LAYERS = 2
"""The sweep's Llama: 2 decoder layers of offload_bench.py's ladder (27.8M parameters), for the honesty check."""
STAGE3_SYSTEMS = ("az3", "fsdp2", "ds3")
"""Systems that gather parameters in forward and in backward: 3Ψ(W−1)/W moved per step, not 2Ψ(W−1)/W."""


def comm_formula(system: str, params: int, world_size: int) -> tuple[str, float]:
    """The ZeRO paper's bytes per step per rank for `system` (fp32 elements, ring volume): (text, bytes)."""
    factor = 3 if system in STAGE3_SYSTEMS else 2
    return f"{factor}Ψ(W−1)/W·4", summary.comm_formula_bytes(params, world_size, factor)


def _mb(value: float | None, digits: int = 1) -> str:
    return report.fmt(None if value is None else value / MB, digits)


# ------------------------------------------------------------------------------------ the systems compared
def memory_table(summaries: list[summary.Summary]) -> str:
    """Memory per rank (max over ranks) of every system beside the ZeRO formula for fp32 Adam."""
    rows = []
    for s in summaries:
        formula = s.memory_formula_mb
        rows.append((
            PEERS[s.system].label, FORMULA_TEXT[PEERS[s.system].memory], report.fmt(formula), report.fmt(s.held_mb),
            report.ratio(s.held_mb, formula), report.fmt(s.live_tensor_mb), report.ratio(s.live_tensor_mb, formula),
            report.fmt(s.rss_mb), report.ratio(s.rss_mb, formula), report.fmt(s.anon_rss_mb),
            report.fmt(s.peak_rss_mb),
        ))  # fmt: skip
    columns = ["system", "ZeRO formula", "formula (MB)", "engine-held (MB)", "held / formula", "live tensors (MB)",
               "live / formula", "RSS (MB)", "RSS / formula", "anonymous RSS (MB)", "peak RSS (MB)"]  # fmt: skip
    return report.table(columns, rows, "ll" + "r" * 9)


def traffic_time_table(summaries: list[summary.Summary], ddp: summary.Summary | None) -> str:
    """Bytes moved per step per rank beside the formula, and the median step time as a ratio to DDP's."""
    rows = []
    for s in summaries:
        text, formula = comm_formula(s.system, s.params, s.world_size)
        counted, wire = s.comm_mb_per_step * MB, s.wire_mb_per_step * MB
        rows.append((
            PEERS[s.system].label, _mb(counted), PEERS[s.system].counted_by, f"{text} = {_mb(formula)}",
            report.ratio(counted, formula), _mb(wire), report.ratio(wire, formula), f"{s.step_ms:.0f}",
            f"{s.step_ms_p25_p75[0]:.0f}–{s.step_ms_p25_p75[1]:.0f}",
            " / ".join(f"{ms:.0f}" for ms in s.step_ms_by_round),
            f"**{report.ratio(s.step_ms, ddp.step_ms if ddp else None)}**", f"{s.cpu_ms_per_rank:.0f}",
            f"{s.final_loss:.7f}",
        ))  # fmt: skip
    columns = ["system", "bytes per step per rank (MB)", "counted by", "ZeRO formula (MB)", "counted / formula",
               "wire bytes (MB)", "wire / formula", "step ms (median)", "p25–p75", "median by round",
               "step time / DDP", "CPU ms per step", "final loss"]  # fmt: skip
    return report.table(columns, rows, "lrlrrrrrrlrrr")


def step_ratio_spread(summaries: list[summary.Summary]) -> float | None:
    """How far DDP's own rounds are apart (max/min of its per-round medians): the noise floor of the ratios."""
    ddp = next((s for s in summaries if s.system == "ddp"), None)
    if ddp is None or len(ddp.step_ms_by_round) < 2:
        return None
    return max(ddp.step_ms_by_round) / min(ddp.step_ms_by_round)


# ------------------------------------------------------------------------------ memory against world size
@dataclass(frozen=True)
class SweepRow:
    """One rank at one stage and world size: what it held (run_report.sweep) and what the estimate says."""

    stage: int
    world_size: int
    rank: int
    params: int
    measured: dict[str, int]
    """`engine.memory_breakdown()`."""
    estimated: dict[str, int]
    """`estimate_stage(...).device` for the same model, config, world size and rank."""
    live_tensor_bytes: int
    rss_bytes: int
    model: str = "linear"
    """"linear" (harness/models.py's stack) or "llama" (offload_bench.py's ladder, 2 layers)."""

    @property
    def measured_model_states(self) -> int:
        return sum(self.measured[kind] for kind in MODEL_STATE_KINDS)

    @property
    def estimated_model_states(self) -> int:
        return sum(self.estimated[kind] for kind in MODEL_STATE_KINDS)

    @property
    def ratio(self) -> float:
        """Estimated over measured model-state bytes."""
        return self.estimated_model_states / self.measured_model_states

    @property
    def formula_bytes(self) -> float:
        return summary.memory_formula_bytes(f"az{self.stage}", self.params, self.world_size)


def sweep_rows(
    readings: dict[int, list[dict[str, Any]]],
    estimates: dict[tuple[int, int, int], dict[str, int]],
    model: str = "linear",
) -> list[SweepRow]:
    """Joins the sweep's per-rank readings (by world size) with the estimates keyed (stage, W, rank); `model`
    "llama" takes the readings the sweep added with `llama=True` (where there are some) instead of the stack's."""
    key, params_key = ("llama_stages", "llama_params") if model == "llama" else ("stages", "params")
    rows = [
        SweepRow(
            int(stage),
            world_size,
            rank["rank"],
            rank[params_key],
            reading["memory_breakdown"],
            estimates[(int(stage), world_size, rank["rank"])],
            reading["live_tensor_bytes"],
            reading["rss_bytes"],
            model,
        )  # fmt: skip
        for world_size, ranks in sorted(readings.items())
        for rank in ranks
        for stage, reading in rank.get(key, {}).items()
    ]
    return sorted(rows, key=lambda r: (r.stage, r.world_size, r.rank))


def _by_point(rows: list[SweepRow]) -> dict[tuple[str, int, int], list[SweepRow]]:
    points: dict[tuple[str, int, int], list[SweepRow]] = {}
    for row in rows:
        points.setdefault((row.model, row.stage, row.world_size), []).append(row)
    return dict(sorted(points.items(), key=lambda item: (item[0][0] != "linear", item[0])))


def sweep_table(rows: list[SweepRow]) -> str:
    """Per stage and world size (max over ranks): formula, estimate, memory_breakdown, live tensors, RSS."""
    table_rows = [
        (stage, world_size, _mb(point[0].formula_bytes), *(
            _mb(max(value(r) for r in point)) for value in (
                lambda r: r.estimated_model_states, lambda r: r.measured_model_states, lambda r: r.measured["total"],
                lambda r: r.estimated["total"], lambda r: r.live_tensor_bytes, lambda r: r.rss_bytes,
            )
        ))
        for (_, stage, world_size), point in _by_point(rows).items()
    ]  # fmt: skip
    columns = ["stage", "W", "ZeRO formula (MB)", "estimated model states (MB)",
               "memory_breakdown() model states (MB)", "memory_breakdown() total (MB)", "estimated total (MB)",
               "live tensors (MB)", "RSS (MB)"]  # fmt: skip
    return report.table(columns, table_rows, "r" * 9)


def honesty_table(rows: list[SweepRow]) -> tuple[str, bool]:
    """The estimate of model-state bytes per rank against `memory_breakdown()`, one line per model, stage and world
    size with the rank whose ratio is farthest from 1; True when every rank is within `HONESTY_TOLERANCE`."""
    table_rows, all_pass = [], bool(rows)
    for (model, stage, world_size), point in _by_point(rows).items():
        worst = max(point, key=lambda r: abs(r.ratio - 1))
        passed = abs(worst.ratio - 1) <= HONESTY_TOLERANCE
        all_pass &= passed
        table_rows.append((model, stage, world_size, _mb(worst.estimated_model_states, 3),
                           _mb(worst.measured_model_states, 3), f"{worst.ratio:.4f} (rank {worst.rank})",
                           "PASS" if passed else "FAIL"))  # fmt: skip
    columns = ["model", "stage", "W", "estimated model states per rank (MB)", "memory_breakdown() model states (MB)",
               "estimate / measured (worst rank)", "within 10%"]  # fmt: skip
    return report.table(columns, table_rows, "lrrrrrl"), all_pass


def plot_series(rows: list[SweepRow]) -> dict[int, dict[str, list[float]]]:
    """Per stage: world sizes and, in MB (max over ranks), formula, estimate, memory_breakdown and live tensors."""
    series: dict[int, dict[str, list[float]]] = {}
    values = {
        "formula": lambda r: r.formula_bytes, "estimated": lambda r: r.estimated_model_states,
        "estimated_total": lambda r: r.estimated["total"], "measured": lambda r: r.measured_model_states,
        "live_tensors": lambda r: r.live_tensor_bytes,
    }  # fmt: skip
    for (_, stage, world_size), point in _by_point([r for r in rows if r.model == "linear"]).items():
        entry = series.setdefault(stage, {"world_size": [], **{name: [] for name in values}})
        entry["world_size"].append(world_size)
        for name, value in values.items():
            entry[name].append(max(value(r) for r in point) / MB)
    return series


# ------------------------------------------------------------------------------ questions the report runs
def markdown_tables(text: str) -> str:
    """The markdown table lines (and the blank lines between tables) of a benchmark's printed output."""
    kept, previous_was_table = [], False
    for line in text.splitlines():
        is_table = line.lstrip().startswith("|")
        if is_table:
            if kept and not previous_was_table:
                kept.append("")
            kept.append(line.strip())
        previous_was_table = is_table
    return "\n".join(kept)


def question_section(ran: dict[str, Any] | None, how_to_run: str, header_prefix: str | None = None) -> str:
    """A question the report ran (run_report.run_question): its command, how it ended, the header line that
    starts with `header_prefix` and its printed tables; or why it did not run (`how_to_run` runs it by hand)."""
    if ran is None:
        return "Not run: this report's readings predate it."
    if ran["status"] == "skipped":
        return f"Not run (skipped by an option of the report): `{how_to_run}` runs it (bench/README.md)."
    command = " ".join(["python", *(_relative(part) for part in ran["command"][1:])])
    out = f"`{command}`, run by the report in {ran.get('seconds', 0):.0f} s: {ran['status']}."
    printed = ran.get("stdout", "")
    header = [line for line in printed.splitlines() if header_prefix and line.startswith(header_prefix)]
    tables = markdown_tables(printed)
    return out + "".join(f"\n\n{part}" for part in (header[:1] + [tables]) if part)


def _relative(part: str) -> str:
    """A command argument with this checkout's path cut off (bench/x.py rather than /home/.../bench/x.py)."""
    marker = "/bench/"
    return "bench/" + part.split(marker, 1)[1] if marker in part else part
