"""Every rank's `Measurement` of a training run, combined into one `Summary` per peer (pure Python). MB = 10**6
bytes. Memory is the max over ranks, time the median over steps of the slowest rank; with several rounds, memory,
bytes and loss come from the first round (they repeat exactly) and the step times pool every round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .peers import PEERS


MB = 1e6
BYTES_FP32 = 4
STAGE3_SYSTEMS = ("az3", "fsdp2", "ds3")
"""Peers that gather the parameters in forward and in backward: 3Ψ(W−1)/W moved per step, not 2Ψ(W−1)/W."""


@dataclass
class Summary:
    """One peer's numbers (see the module docstring)."""

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
    """2Ψ(W−1)/W·4 bytes, 3Ψ(W−1)/W·4 for `STAGE3_SYSTEMS`."""
    step_ms: float
    step_ms_p25_p75: tuple[float, float]
    step_ms_by_round: list[float]
    cpu_ms_per_rank: float
    minor_faults_per_step: float | None
    loadavg_1min: list[list[float] | None]
    final_loss: float
    comm_by_kind: dict[str, Any]
    memory_breakdown: dict[str, int] | None


def records(ranks: Any) -> list[dict[str, Any]]:
    """The `Measurement` of every rank of one `launch.Ranks`, with the group's 1-minute load average (before,
    after) in `extra["loadavg_1min"]`."""
    out = [dict(result) for result in ranks.results]
    for result in out:
        result["extra"] = dict(result["extra"], loadavg_1min=list(ranks.load))
    return out


def memory_formula_bytes(system: str, params: int, world_size: int) -> float:
    """The ZeRO paper's bytes per rank of `system` for fp32 Adam (`peers.Peer.memory`)."""
    replicated, sharded = PEERS[system].memory
    return params * (replicated + sharded / world_size)


def comm_formula_bytes(params: int, world_size: int, factor: int = 2) -> float:
    """factor·Ψ(W−1)/W elements of 4 bytes: 2 for one all-reduce of the gradients (or a reduce-scatter plus an
    all-gather), 3 at stage 3 (an all-gather in forward and in backward, a reduce-scatter)."""
    return factor * params * (world_size - 1) / world_size * BYTES_FP32


def summarize(system: str, rounds: list[list[dict[str, Any]]]) -> Summary:
    """Combines every rank's raw measurement (`steps.Measurement` as a dict), round by round, into one Summary."""
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
        comm_formula_mb=comm_formula_bytes(params, world_size, 3 if system in STAGE3_SYSTEMS else 2) / MB,
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
