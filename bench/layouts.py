"""Stage 3 on 2 simulated nodes: flat, hpZ, MiCS and ZeRO++ (hpZ + qwZ + qgZ), bytes between nodes per step
against the formulas of accelerate_zero/debug/layouts.py, time per step, memory, and the loss against flat (issue 32;
bench/README.md, "layouts.py").

Usage:
    .venv/bin/python bench/layouts.py                     # W = 4 and 8 (2 nodes x 2 and x 4), ~3 min on 2 cores
    .venv/bin/python bench/layouts.py --world 4 --hidden 256 --layers 4 --json bench/out/layouts.json
    .venv/bin/python bench/layouts.py --sft 100           # the SFT recipe's loss curve: flat, ZeRO++, flat seed 43
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import launch, report


NODES, GRAD_ACCUM, SEQ, VOCAB = 2, 2, 64, 2048
DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce_replicas")
DATA_PREFIXES = ("all_gather_", "all_to_all_")
NODES_ENV = {"ACCELERATE_ZERO_SIMULATED_NODES": str(NODES)}


def _layouts(per_node: int) -> dict[str, dict[str, Any]]:
    zero_pp = {"zero_hpz_partition_size": per_node, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    return {
        "flat": {},
        "hpZ": {"zero_hpz_partition_size": per_node},
        "MiCS": {"mics_shard_size": per_node},
        "ZeRO++": zero_pp,
    }


def _between(stats: dict, data: bool) -> float:
    """Bytes between nodes of the parameters and gradients (`data`), or of everything else: the gradient norm, the
    step-position checks ([Note: ranks out of step] in engine/progress.py)."""
    return sum(v["between_nodes_bytes"] for k, v in stats.items()
               if k != "total" and (k in DATA_KINDS or k.startswith(DATA_PREFIXES)) == data)  # fmt: skip


def train_layouts(hidden: int, layers: int, steps: int) -> dict[str, dict[str, Any]]:
    """Rank function: every layout in turn on the same Llama and data; this rank's readings per layout."""
    import torch
    import torch.distributed as dist
    from harness import models

    import accelerate_zero

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, extra in _layouts(world // NODES).items():
        model = models.llama(models.llama_config(hidden, layers, vocab=VOCAB, heads=4, seq=SEQ))
        numel = sum(p.numel() for p in model.parameters())
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **extra}
        config = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 1.0, "zero_optimization": zero}
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
        data = models.tokens(steps * GRAD_ACCUM * world, SEQ, VOCAB, seed=7).view(steps * GRAD_ACCUM, world, SEQ)
        between, control, losses, seconds = [], [], [], []
        for step in range(steps):
            engine.reset_comm_stats()
            start = time.perf_counter()
            for micro in range(GRAD_ACCUM):
                tokens = data[step * GRAD_ACCUM + micro][rank : rank + 1]
                loss = engine(input_ids=tokens, labels=tokens).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            seconds.append(time.perf_counter() - start)
            between.append(_between(engine.comm_stats(), data=True))
            control.append(_between(engine.comm_stats(), data=False))
        flats, buckets = [f.plan for u in engine.units for f in u.flats], [b.plan for b in engine.reducer.buckets]
        sizes = {
            "P": sum(plan.numel * 4 for plan in flats),
            "G": sum(plan.numel * 4 for plan in buckets),
            # ZeRO++ on the wire: each rank's shard in whole blocks of 256 int8 codes (64 int4 codes for gradients),
            # and a 4-byte scale per block
            "P8": sum(world * -(-plan.shard_numel // 256) * 260 for plan in flats),
            "G4": sum(world * -(-plan.shard_numel // 64) * 36 for plan in buckets),
            "numel": numel,
        }
        out[name] = {"between": between, "control": control, "losses": losses, "seconds": seconds, "sizes": sizes,
                     "held": engine.memory_breakdown()["total"], "kind": engine.layout.plan.kind}  # fmt: skip
        engine.destroy()
    return out


def _summarise(world: int, ranks: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    from accelerate_zero.debug.layouts import layout_rows

    rows, flat_losses = [], ranks[0]["flat"]["losses"]
    for name, first in ranks[0].items():
        steps, sizes = len(first["between"]), first["sizes"]
        formulas = {
            row.name: row
            for row in layout_rows(sizes["P"] // 4, sizes["G"] // 4, 4, 4, NODES, world // NODES, first["held"])
        }
        formula = formulas[name].traffic.between * NODES * GRAD_ACCUM
        if name == "ZeRO++":  # the estimator's row leaves out the padding of each shard to whole blocks
            formula = (NODES - 1) * GRAD_ACCUM * (sizes["P8"] + sizes["G4"])
        measured = sum(sum(r[name]["between"]) for r in ranks) / steps
        rows.append({
            "world": world, "layout": name, "between_nodes_MB_per_step": measured / 1e6, "formula_MB": formula / 1e6,
            "ratio": measured / formula, "held_MB_rank0": first["held"] / 1e6, "final_loss": first["losses"][-1],
            "seconds_per_step": sum(max(r[name]["seconds"][i] for r in ranks) for i in range(1, steps))
            / max(1, steps - 1),
            "max_loss_gap": max(abs(a - b) / b for a, b in zip(first["losses"], flat_losses, strict=True)),
            "control_bytes_per_step": sum(sum(r[name]["control"]) for r in ranks) / steps,
            "parameters": sizes["numel"],
        })  # fmt: skip
    flat = rows[0]["between_nodes_MB_per_step"]
    for row in rows:
        row["vs_flat"] = flat / row["between_nodes_MB_per_step"] if row["between_nodes_MB_per_step"] else None
    return rows


def sft_curves(steps: int) -> None:
    """The SFT recipe (recipes/sft.py, the embedded tiny Llama) on 4 processes as 2 simulated nodes: flat stage 3,
    ZeRO++ and flat with another data seed; the loss every 10 steps. The bound for ZeRO++ is the seed's: quantized
    collectives must move the curve less than another shuffle of the same data does."""
    root = Path(__file__).resolve().parents[1]
    curves = {}
    for name, (extra, seed) in {
        "flat": ({}, 42),
        "ZeRO++": (_layouts(2)["ZeRO++"], 42),
        "flat, seed 43": ({}, 43),
    }.items():
        folder = Path(tempfile.mkdtemp())
        keys = "".join(f"  {key}: {str(value).lower()}\n" for key, value in extra.items())
        demo = (root / "accelerate_configs" / "zero3_demo.yaml").read_text()
        (folder / "accelerate.yaml").write_text(demo.replace("  zero_stage: 3\n", keys + "  zero_stage: 3\n"))
        command = [sys.executable, "-m", "accelerate_zero.cli.main", "launch", "--config_file",
                   str(folder / "accelerate.yaml"), "--num_processes", "4", str(root / "recipes" / "sft.py"),
                   "--config", str(root / "recipes" / "configs" / "sft_demo.yaml"), "--max_steps", str(steps),
                   "--logging_steps", "10", "--seed", str(seed), "--output_dir", str(folder / "out"),
                   "--eval_samples", "10"]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, env={**os.environ, **NODES_ENV}, cwd=root, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
        curves[name] = [float(v) for v in re.findall(r"'loss': '?([0-9.]+)'?", done.stdout + done.stderr)]
        print(f"{name}: {time.perf_counter() - start:.0f} s, losses {curves[name]}")
    for name in ("ZeRO++", "flat, seed 43"):
        gaps = [abs(a - b) for a, b in zip(curves[name], curves["flat"], strict=True)]
        print(f"{name} against flat: max |loss gap| {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sft", type=int, default=0, metavar="STEPS", help="run the SFT recipe's loss curves")
    args = parser.parse_args()
    if args.sft:
        sft_curves(args.sft)
        return
    facts, rows = report.machine_facts(), []
    for world in args.world:
        kwargs = {"hidden": args.hidden, "layers": args.layers, "steps": args.steps}
        rows += _summarise(
            world, launch.on_ranks(world, train_layouts, kwargs, name=f"w{world}", env=NODES_ENV).results
        )
    print(report.header(facts, f"layouts: stage 3 on {NODES} simulated nodes, W = {args.world}"))
    columns = ["W", "layout", "between nodes MB/step", "formula MB", "ratio", "flat / this", "s/step",
               "held MB (rank 0)", "max loss gap"]  # fmt: skip
    print(report.table(columns, [
        (r["world"], r["layout"], f"{r['between_nodes_MB_per_step']:.2f}", f"{r['formula_MB']:.2f}",
         f"{r['ratio']:.4f}", f"{r['vs_flat']:.2f}x" if r["vs_flat"] else "-", f"{r['seconds_per_step']:.3f}",
         f"{r['held_MB_rank0']:.1f}", f"{r['max_loss_gap']:.2e}") for r in rows
    ], "rlrrrrrrr"))  # fmt: skip
    print(f"parameters: {rows[0]['parameters']:,}")
    control = max(r["control_bytes_per_step"] for r in rows)
    print(f"other bytes between nodes (gradient norm, step checks): at most {control:.0f} per step")
    if args.json:
        report.save_json(args.json, {"rows": rows}, facts)


if __name__ == "__main__":
    main()
