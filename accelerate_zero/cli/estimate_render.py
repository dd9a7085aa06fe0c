"""The human table of `accelerate-zero estimate`: one line per (stage, offload), then the recommendation."""

from __future__ import annotations

import json
from typing import Any

from accelerate_zero.cli.estimate_time import render_lines


def format_bytes(value: int | None) -> str:
    """Binary units with 3 significant digits: "512 B", "1.5 KiB", "12.4 GiB"; "-" for 0 and None."""
    if not value:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            number = value / scale
            return f"{number:.3g} {unit}" if number < 1000 else f"{number:.0f} {unit}"
    return f"{value} B"


_COLUMNS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("master", "master_weights"),
    ("optim", "optimizer_states"),
    ("buffers", "communication_buffers"),
    ("gathered", "gathered_parameters"),
    ("activ.", "activations"),
    ("GPU total", "total"),
)


def render(report: dict[str, Any]) -> str:
    """The human table: one line per (stage, offload), then the recommendation and the notes."""
    header = ["stage", "offload", *(title for title, _ in _COLUMNS), "fits", "CPU/node", "NVMe/node"]
    lines = [header]
    for row in report["estimates"]:
        fits = {True: "yes", False: "no", None: "?"}[row["fits"]]
        values = [format_bytes(row["device"][kind]) for _, kind in _COLUMNS]
        node = [format_bytes(row["cpu_ram_per_node"]), format_bytes(row["nvme_per_node"])]
        lines.append([str(row["stage"]), row["offload"], *values, fits, *node])
    table = _aligned(lines)
    layouts = _layout_table(report)
    return "\n".join(
        [
            *_summary(report),
            "",
            *table,
            "",
            *_phase_table(report),
            "",
            *render_lines(report),
            *layouts,
            *([""] if layouts else []),
            *_closing(report),
        ]
    )


_PHASE_TITLES = {"init": "init", "forward": "forward", "backward": "backward", "optimizer_step": "step"}
_PHASE_TITLES["between_steps"] = "between steps"


def _phase_table(report: dict[str, Any]) -> list[str]:
    """The peak per GPU of each phase, per (stage, offload) ([Note: the peak of each phase] in debug/phases.py)."""
    phases = list(report["estimates"][0]["phases"]) if report["estimates"] else []
    lines = [["stage", "offload", *(_PHASE_TITLES.get(p, p) for p in phases)]]
    for row in report["estimates"]:
        lines.append([str(row["stage"]), row["offload"], *(format_bytes(row["phases"][p]) for p in phases)])
    return ["peak per GPU in each phase (the columns above that coexist then):", *_aligned(lines)]


def _layout_table(report: dict[str, Any]) -> list[str]:
    """Stage 3's layouts on several nodes: bytes per node and micro-step, memory per GPU."""
    layouts = report.get("layouts")
    if not layouts:
        return []
    lines = [["layout", "", "between nodes", "inside node", "model states", "hpZ copy", "exact"]]
    for row in layouts["rows"]:
        lines.append(
            [
                row["layout"],
                "",
                format_bytes(row["between_nodes_per_micro_step"]),
                format_bytes(row["inside_node_per_micro_step"]),
                format_bytes(row["model_states"]),
                format_bytes(row["secondary_copy"]),
                "yes" if row["exact"] else "no (quantized)",
            ]
        )
    chosen = next(row for row in layouts["rows"] if row["layout"] == layouts["recommended"])
    return [
        "stage 3 layouts, bytes per node and micro-step (units released after forward) and per GPU:",
        *_aligned(lines),
        f"layout recommendation: {chosen['layout']} {json.dumps(chosen['zero_optimization'])}: the exact layout "
        "that fits and sends the fewest bytes between nodes",
    ]


def _aligned(lines: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell: the first two (stage, offload) left-aligned, the numbers right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]


def _summary(report: dict[str, Any]) -> list[str]:
    model, setup = report["model"], report["setup"]
    layout = f"{model['stage3_units']} stage-3 units" if model["exact_layout"] else "no layer layout"
    nodes = "node" if setup["num_nodes"] == 1 else "nodes"
    precision = {"no": "fp32", "fp16": "fp16 mixed precision", "bf16": "bf16 mixed precision"}
    batch = f"micro batch {setup['micro_batch']} x {setup['seq_len']} tokens"
    checkpointing = ", gradient checkpointing" if setup["gradient_checkpointing"] else ""
    lines = [
        f"model: {model['name']} (from {model['source']}): {model['num_parameters'] / 1e9:.4g}B parameters, {layout}",
        f"setup: {setup['world_size']} GPUs ({setup['num_gpus']} per node x {setup['num_nodes']} {nodes}), "
        f"{precision[setup['mixed_precision']]}, {setup['optimizer']}, {batch}{checkpointing}",
    ]
    if setup["gpu_memory"] is not None:
        lines.append(
            f"budget: {format_bytes(setup['gpu_memory'])} per GPU, {format_bytes(setup['usable_gpu_memory'])} "
            f"usable ({setup['headroom']:.0%} headroom); bytes are per GPU, CPU RAM and NVMe per node"
        )
    return lines


def _closing(report: dict[str, Any]) -> list[str]:
    lines = []
    choice = report["recommendation"]
    if choice is not None:
        row = next(
            r for r in report["estimates"] if (r["stage"], r["offload"]) == (choice["stage"], choice["offload"])
        )
        how = "without offload" if choice["offload"] == "none" else f"with {choice['offload']} offload"
        lines.append(
            f"recommendation: ZeRO stage {choice['stage']} {how} ({format_bytes(row['device']['total'])} of "
            f"{format_bytes(report['setup']['usable_gpu_memory'])} usable per GPU): the cheapest that fits; "
            "lower stages communicate less, offload is slower"
        )
        lines.append(f"  {json.dumps(choice['deepspeed_config'])}")
    lines += [f"note: {note}" for note in report["notes"]]
    return lines
