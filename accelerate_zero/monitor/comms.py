"""`comms_logger`: the count, size and latency of every collective the engine issues, summarized as DeepSpeed's
`deepspeed.comm.log_summary()` prints it.

The engine's collectives report to a `CommsLog` through their counters ([Note: timing collectives] in
engine/collectives.py: each timed collective is waited for, as DeepSpeed's logger makes every op blocking). The
records are named by our collective kinds (`reduce_scatter`, `all_gather`, `all_to_all_sequence`, ...), which say
what each one is for; `prof_ops` selects by those names. Message size is the whole buffer a call works on (the input
of a reduction, the output of a gather); the bandwidths follow DeepSpeed's `calc_bw_log` for the collective's
pattern: algbw = size / latency (all-reduce: 2 x), busbw = size / latency x 2(n-1)/n for an all-reduce, (n-1)/n for a
gather, reduce-scatter or all-to-all, 1 for the rest, in Gbps.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import defaultdict
from typing import Any


logger = logging.getLogger("accelerate_zero")

_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
            "busbw_avg (Gbps)")  # fmt: skip


def convert_size(size_bytes: float) -> str:
    """Bytes as DeepSpeed prints them ("678.86 MB")."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(names) - 1)
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def trim_mean(values: list[float], share: float = 0.1) -> float:
    """The mean without the `share` smallest and largest values (DeepSpeed's `trim_mean`)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = int(round(len(ordered) * share))
    kept = ordered[k : len(ordered) - k]
    return sum(kept) / len(kept)


def bandwidths(kind: str, size: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps for `size` bytes moved by a collective of `kind` in `seconds`."""
    if seconds <= 0:
        return 0.0, 0.0
    n = world_size
    if kind.startswith("all_reduce"):
        algbw, busbw = 2 * size / seconds, size / seconds * 2 * (n - 1) / n
    elif kind.startswith(("all_gather", "reduce_scatter", "all_to_all")):
        algbw, busbw = size / seconds, size / seconds * (n - 1) / n
    else:
        algbw = busbw = size / seconds
    return algbw * 8 / 1e9, busbw * 8 / 1e9


DEEPSPEED_OPS = {
    "all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather", "all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_fn": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter", "all_to_all_single": "all_to_all", "all_reduce_coalesced": "all_reduce",
    "inference_all_reduce": "all_reduce",
}  # fmt: skip
"""DeepSpeed's op names in `prof_ops` -> the kind our collectives' names begin with (`all_gather` also selects
`all_gather_sequence_logits`, ...)."""


class CommsLog:
    """The records of the config's `comms_logger` block (every rank keeps its own; rank 0 prints)."""

    def __init__(self, block: Any, rank: int, world_size: int) -> None:
        self.prof_all = bool(block.prof_all)
        self.prof_ops = tuple(DEEPSPEED_OPS.get(op, op) for op in block.prof_ops)
        self.verbose, self.debug = bool(block.verbose), bool(block.debug)
        self.rank, self.world_size = rank, world_size
        self.records: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        """name -> message size -> latencies in seconds."""

    def wants(self, kind: str) -> bool:
        """Whether collectives of `kind` are timed (`prof_all`, else `prof_ops`)."""
        return self.prof_all or kind.startswith(self.prof_ops)

    def add(self, kind: str, payload_bytes: int, seconds: float) -> None:
        name = f"{kind} | [Caller Func: {_caller()}]" if self.debug else kind
        self.records[name][payload_bytes].append(seconds)
        if self.verbose and self.rank == 0:
            algbw, busbw = bandwidths(kind, payload_bytes, seconds, self.world_size)
            logger.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                name, 1000 * seconds, convert_size(payload_bytes), algbw, busbw,
            )  # fmt: skip

    def summary(self) -> str:
        """The table DeepSpeed's `log_summary` prints: per collective and message size, the count, total and
        trimmed-mean latency and bandwidths."""
        lines = ["".join(f"{title: <20}" for title in _COLUMNS)]
        for name, sizes in self.records.items():
            lines.append(name)
            kind = name.split(" | ", 1)[0]
            for size, latencies in sorted(sizes.items()):
                rates = [bandwidths(kind, size, s, self.world_size) for s in latencies]
                cells = (
                    convert_size(size),
                    str(len(latencies)),
                    f"{1000 * sum(latencies):.2f}",
                    f"{1000 * trim_mean(latencies):.2f}",
                    f"{trim_mean([r[0] for r in rates]):.2f}",
                    f"{trim_mean([r[1] for r in rates]):.2f}",
                )
                lines.append(" " * 20 + "".join(f"{cell: <20}" for cell in cells))
        return "\n".join(lines)

    def log_summary(self) -> None:
        """Logs `summary()` on rank 0, at INFO on the engine's logger (DeepSpeed's `deepspeed.comm.log_summary()`
        prints it to stdout)."""
        if self.rank == 0:
            logger.info("%s", self.summary())

    def reset(self) -> None:
        self.records.clear()


def _caller() -> str:
    """The first function outside the collectives and this module (DeepSpeed names the caller of the op)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(("collectives.py", "comms.py")):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"
