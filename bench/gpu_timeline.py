"""One training step as lanes over time (compute, device-to-host, host step, host-to-device, file I/O), read from a
torch.profiler trace and drawn as SVG, for bench/gpu_compare_worker.py ([Note: timeline lanes] is bench/README.md's
"The timeline of one step": where each lane comes from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


LANES = ("compute", "device-to-host", "host step", "host-to-device", "file I/O")
COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
STEP_RANGE = "bench::step"

_CPU_RANGES = {
    "bench::forward": "compute",
    "bench::backward": "compute",
    "ZeRO::copy_to_host": "device-to-host",
    "ZeRO::copy_to_device": "host-to-device",
    "ZeRO::optimizer_step": "host step",
    "ZeRO::file_read": "file I/O",
    "ZeRO::file_write": "file I/O",
}


def _lane_of(event: dict[str, Any], gpu: bool) -> str | None:
    category, name = event.get("cat", ""), event.get("name", "")
    if category == "kernel":
        return "compute"
    if category == "gpu_memcpy":
        if "DtoH" in name:
            return "device-to-host"
        if "HtoD" in name:
            return "host-to-device"
        return None
    if category != "user_annotation":
        return None
    lane = _CPU_RANGES.get(name)
    if gpu and lane in ("compute", "device-to-host", "host-to-device"):
        return None  # the GPU's own events say when these ran
    return lane


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def lanes_from_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The lanes of the last `bench::step` range in a chrome trace (`prof.export_chrome_trace`), in milliseconds
    from the step's start: {"step_ms", "gpu", "lanes": {lane: [[start, end], ...]}, "busy": {lane: share}}.

    Raises:
        ValueError: the trace holds no `bench::step` range (the worker did not label its step).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"]
    if not steps:
        raise ValueError(f"no {STEP_RANGE!r} range in the trace: wrap the step in record_function({STEP_RANGE!r})")
    step = max(steps, key=lambda e: e["ts"])
    begin, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    gpu = any(e.get("cat") == "kernel" for e in events)
    found: dict[str, list[tuple[float, float]]] = {lane: [] for lane in LANES}
    for event in events:
        lane = _lane_of(event, gpu)
        if lane is None:
            continue
        start, stop = max(float(event["ts"]), begin), min(float(event["ts"]) + float(event["dur"]), end)
        if stop > start:
            found[lane].append(((start - begin) / 1e3, (stop - begin) / 1e3))
    span = (end - begin) / 1e3
    lanes = {lane: [list(i) for i in _union(found[lane])] for lane in LANES}
    busy = {lane: round(sum(b - a for a, b in lanes[lane]) / span, 4) if span else 0.0 for lane in LANES}
    return {"step_ms": round(span, 3), "gpu": gpu, "lanes": lanes, "busy": busy}


def _coarse(intervals: list[list[float]], gap: float) -> list[list[float]]:
    """Joins intervals closer than `gap` so a step of thousands of kernels draws as a few hundred boxes."""
    out: list[list[float]] = []
    for start, end in intervals:
        if out and start - out[-1][1] < gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def svg(timeline: dict[str, Any], title: str, width: int = 1100) -> str:
    """The timeline as a standalone SVG drawing (no dependencies)."""
    left, row, top = 130, 26, 34
    span = timeline["step_ms"] or 1.0
    scale = (width - left - 20) / span
    height = top + row * len(LANES) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13">{_escape(title)}</text>',
    ]
    for index, (lane, colour) in enumerate(zip(LANES, COLOURS, strict=True)):
        y = top + index * row
        busy = timeline["busy"][lane]
        parts.append(f'<text x="4" y="{y + 15}">{_escape(lane)} {busy:.0%}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{width - left - 20}" height="{row - 6}" fill="#f2f2f2"/>')
        for start, end in _coarse(timeline["lanes"][lane], gap=0.5 / scale):
            w = max((end - start) * scale, 0.5)
            parts.append(
                f'<rect x="{left + start * scale:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{colour}"/>'
            )
    axis = top + row * len(LANES) + 14
    for tick in range(6):
        x = left + (width - left - 20) * tick / 5
        parts.append(f'<text x="{x:.0f}" y="{axis}" text-anchor="middle">{span * tick / 5:.0f} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_drawing(timeline: dict[str, Any], title: str, stem: Path) -> Path:
    """Writes `<stem>.svg`; returns its path."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.with_suffix(".svg")
    path.write_text(svg(timeline, title))
    return path
