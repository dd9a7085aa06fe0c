"""How every question reports (pure Python): markdown tables, PASS/FAIL/SKIP checks, the machine and its load in a
header, the JSON it saves.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .peers import PEERS
from .summary import MB, Summary


REPO = Path(__file__).resolve().parents[2]
VERSIONED = ("torch", "transformers", "accelerate", "deepspeed")


def fmt(value: float | None, digits: int = 1) -> str:
    """`value` with thousands separators, or "—" for a reading that was not taken."""
    return "—" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None, reference: float | None) -> str:
    """value / reference to two decimals, or "—" when either is missing."""
    return "—" if value is None or not reference else f"{value / reference:.2f}"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; `align` is one letter per column, "l" or "r" (default: the first left, the rest right)."""
    align = align or "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns):
        raise ValueError(f"align {align!r} has {len(align)} letters for {len(columns)} columns")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if a == "l" else "--:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Check:
    """A target on a reading: passed True/False, or None (SKIP) when a reading it needs is missing."""

    name: str
    passed: bool | None
    detail: str

    def line(self) -> str:
        verdict = "SKIP" if self.passed is None else ("PASS" if self.passed else "FAIL")
        return f"{verdict}  {self.name}: {self.detail}"


def at_most(name: str, value: float | None, reference: float | None, limit: float, unit: str = "") -> Check:
    """PASS when value <= limit x reference (SKIP when either reading is missing)."""
    if value is None or not reference:
        return Check(name, None, "a reading it compares was not taken")
    detail = f"{value:.1f}{unit} vs {reference:.1f}{unit} (ratio {value / reference:.2f}, limit {limit})"
    return Check(name, value <= limit * reference, detail)


def comm_kind_table(summaries: list[Summary]) -> str:
    """Per collective kind, as each peer counted it (per step per rank)."""
    rows = [(PEERS[s.system].label, kind, f"{entry['calls'] / s.steps:g}",
             f"{entry['payload_bytes'] / s.steps / MB:,.2f}", f"{entry['bytes_per_rank'] / s.steps / MB:,.2f}")
            for s in summaries for kind, entry in s.comm_by_kind.items() if kind != "total"]  # fmt: skip
    columns = ("system", "kind", "calls per step", "payload per step (MB)", "bytes per step per rank (MB)")
    return table(columns, rows, "llrrr")


# ---------------------------------------------------------------------------------------------- the machine
def machine_facts() -> dict[str, Any]:
    """Where a run is: CPU, cores, RAM, versions, the commit (and engine files changed since), the load, the date."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    versions = {}
    for package in VERSIONED:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout

    dirty = git("status", "--porcelain", "--", "accelerate_zero").splitlines()
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": mem_kib / 2**20, "python": platform.python_version(),
            "versions": versions, "commit": git("rev-parse", "--short", "HEAD").strip(),
            "uncommitted_engine_files": [line[3:] for line in dirty],
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg": list(os.getloadavg())}  # fmt: skip


def header(facts: dict[str, Any], title: str) -> str:
    """Two lines: what ran, and where, when (the code, the versions) and at what load (compare ratios within one
    run)."""
    load = ", ".join(f"{value:.1f}" for value in facts["loadavg"])
    changed = len(facts["uncommitted_engine_files"])
    versions = ", ".join(f"{name} {version}" for name, version in facts["versions"].items())
    dirty = f" + {changed} changed engine file(s)" if changed else ""
    return (f"{title}\n{facts['date']}, commit {facts['commit']}{dirty}, {facts['cpu']}, {facts['cores']} cores, "
            f"{facts['ram_gib']:.0f} GiB, Python {facts['python']}, {versions}; load average (1, 5, 15 min) {load} "
            "at the start")  # fmt: skip


def save_json(path: Path, payload: dict[str, Any], facts: dict[str, Any]) -> None:
    """Writes `payload` with the machine facts (and the load at the end) to `path`, and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": facts, "loadavg_end": list(os.getloadavg()), **payload}
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"\nraw numbers: {path}")
