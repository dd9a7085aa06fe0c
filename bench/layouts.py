"""Stage 3 on 2 simulated nodes: flat, hpZ, MiCS and ZeRO++ (hpZ + qwZ + qgZ), bytes between nodes per step
against the formulas of accelerate_zero/debug/layouts.py, time per step, memory, and the loss against flat (issue 32).

Usage:
    .venv/bin/python bench/layouts.py                     # W = 4 and 8 (2 nodes x 2 and x 4), ~3 min on 2 cores
    .venv/bin/python bench/layouts.py --world 4 --hidden 256 --layers 4 --json bench/out/layouts.json
    .venv/bin/python bench/layouts.py --sft 100           # the SFT recipe's loss curve: flat, ZeRO++, flat seed 43

Each world size runs under `torchrun` with ACCELERATE_ZERO_SIMULATED_NODES=2 (engine/nodes.py). A Llama (vocabulary
2048, `--hidden`, `--layers`, untied), fp32, AdamW lr 1e-3, clip 1.0, every tensor partitioned and units released
after forward (`stage3_max_reuse_distance: 0`: the formulas' setting), gradient accumulation 2, one sequence of
64 tokens per rank and micro-step, `--steps` steps per layout. Bytes between nodes (of parameters and gradients; the few bytes of the gradient norm and step checks are printed apart) are the engine's own count
([Note: bytes between nodes] in engine/collectives.py), summed over ranks and averaged over steps; the formula is
`layout_rows` per node and micro-step times nodes times micro-steps, with the engine's padded sizes. On gloo
processes sharing a CPU the times say little about a network: the bytes are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


NODES, GRAD_ACCUM, SEQ, VOCAB = 2, 2, 64, 2048


def _layouts(per_node: int) -> dict[str, dict]:
    return {
        "flat": {},
        "hpZ": {"zero_hpz_partition_size": per_node},
        "MiCS": {"mics_shard_size": per_node},
        "ZeRO++": {
            "zero_hpz_partition_size": per_node,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        },
    }


DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce_replicas")
DATA_PREFIXES = ("all_gather_", "all_to_all_")


def _between(stats: dict, data: bool) -> float:
    """Bytes between nodes of the parameters and gradients (`data`), or of everything else: the gradient norm, the
    step-position checks ([Note: ranks out of step] in engine/progress.py)."""
    return sum(
        v["between_nodes_bytes"]
        for k, v in stats.items()
        if k != "total" and (k in DATA_KINDS or k.startswith(DATA_PREFIXES)) == data
    )


def _run_layout(args: argparse.Namespace, extra: dict, rank: int, world: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import accelerate_zero

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    numel = sum(p.numel() for p in model.parameters())
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **extra}
    engine = accelerate_zero.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 1.0, "zero_optimization": zero},
    )
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (world, SEQ), generator=gen) for _ in range(args.steps * GRAD_ACCUM)]
    between, control, losses, seconds = [], [], [], []
    for step in range(args.steps):
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
    flats = [f.plan for u in engine.units for f in u.flats]
    buckets = [b.plan for b in engine.reducer.buckets]
    sizes = {
        "P": sum(plan.numel * 4 for plan in flats),
        "G": sum(plan.numel * 4 for plan in buckets),
        # ZeRO++ on the wire: each rank's shard in whole blocks of 256 int8 codes (64 int4 codes for gradients),
        # and a 4-byte scale per block
        "P8": sum(world * -(-plan.shard_numel // 256) * 260 for plan in flats),
        "G4": sum(world * -(-plan.shard_numel // 64) * 36 for plan in buckets),
        "numel": numel,
    }
    memory = engine.memory_breakdown()
    engine.destroy()
    return {
        "between": between,
        "control": control,
        "losses": losses,
        "seconds": seconds,
        "sizes": sizes,
        "held": memory["total"],
        "kind": engine.layout.plan.kind,
    }


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for name, extra in _layouts(world // NODES).items():
        mine = _run_layout(args, extra, rank, world)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            results[name] = everyone
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def _summarise(world: int, results: dict) -> list[dict]:
    from accelerate_zero.debug.layouts import layout_rows

    per_node, rows = world // NODES, []
    flat_losses = results["flat"][0]["losses"]
    for name, ranks in results.items():
        first = ranks[0]
        measured = sum(sum(r["between"]) for r in ranks) / len(first["between"])
        sizes = first["sizes"]
        formulas = {
            row.name: row
            for row in layout_rows(sizes["P"] // 4, sizes["G"] // 4, 4, 4, NODES, per_node, first["held"])
        }
        formula = formulas[name].traffic.between * NODES * GRAD_ACCUM
        if name == "ZeRO++":  # the estimator's row leaves out the padding of each shard to whole blocks
            formula = (NODES - 1) * GRAD_ACCUM * (sizes["P8"] + sizes["G4"])
        rows.append(
            {
                "world": world,
                "layout": name,
                "between_nodes_MB_per_step": measured / 1e6,
                "formula_MB": formula / 1e6,
                "ratio": measured / formula,
                "vs_flat": None,
                "seconds_per_step": sum(max(r["seconds"][i] for r in ranks) for i in range(1, len(first["seconds"])))
                / max(1, len(first["seconds"]) - 1),
                "held_MB_rank0": first["held"] / 1e6,
                "max_loss_gap": max(abs(a - b) / b for a, b in zip(first["losses"], flat_losses, strict=True)),
                "final_loss": first["losses"][-1],
                "control_bytes_per_step": sum(sum(r["control"]) for r in ranks) / len(first["control"]),
                "parameters": sizes["numel"],
            }
        )
    flat = next(r for r in rows if r["layout"] == "flat")["between_nodes_MB_per_step"]
    for row in rows:
        row["vs_flat"] = flat / row["between_nodes_MB_per_step"] if row["between_nodes_MB_per_step"] else None
    return rows


def sft_curves(steps: int) -> None:
    """The SFT recipe (recipes/sft.py, the embedded tiny Llama) on 4 processes as 2 simulated nodes: flat stage 3,
    ZeRO++ (hpZ + qwZ + qgZ) and flat with another data seed; the loss every 10 steps. The bound for ZeRO++ is the
    seed's: quantized collectives must move the curve less than another shuffle of the same data does."""
    import re
    import tempfile

    root = Path(__file__).resolve().parents[1]
    runs = {"flat": ({}, 42), "ZeRO++": (_layouts(2)["ZeRO++"], 42), "flat, seed 43": ({}, 43)}
    curves = {}
    for name, (extra, seed) in runs.items():
        folder = Path(tempfile.mkdtemp())
        keys = "".join(f"  {key}: {str(value).lower()}\n" for key, value in extra.items())
        (folder / "accelerate.yaml").write_text(
            (root / "accelerate_configs" / "zero3_demo.yaml")
            .read_text()
            .replace("  zero_stage: 3\n", keys + "  zero_stage: 3\n")
        )
        command = [sys.executable, "-m", "accelerate_zero.cli.main", "launch", "--config_file"]
        command += [str(folder / "accelerate.yaml"), "--num_processes", "4", str(root / "recipes" / "sft.py")]
        command += ["--config", str(root / "recipes" / "configs" / "sft_demo.yaml"), "--max_steps", str(steps)]
        command += [
            "--logging_steps",
            "10",
            "--seed",
            str(seed),
            "--output_dir",
            str(folder / "out"),
            "--eval_samples",
            "10",
        ]
        env = {**os.environ, "ACCELERATE_ZERO_SIMULATED_NODES": str(NODES)}
        start = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
        losses = [float(v) for v in re.findall(r"'loss': '?([0-9.]+)'?", done.stdout + done.stderr)]
        curves[name] = losses
        print(f"{name}: {time.perf_counter() - start:.0f} s, losses {losses}")
    flat = curves["flat"]
    for name in ("ZeRO++", "flat, seed 43"):
        gaps = [abs(a - b) for a, b in zip(curves[name], flat, strict=True)]
        print(f"{name} against flat: max |loss gap| {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--sft", type=int, default=0, metavar="STEPS", help="run the SFT recipe's loss curves")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.sft:
        sft_curves(args.sft)
        return
    rows = []
    for world in args.world:
        out = Path(f"/tmp/az_layouts_{world}.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), __file__]
        command += ["--worker", "--out", str(out), "--hidden", str(args.hidden), "--layers", str(args.layers)]
        command += ["--steps", str(args.steps)]
        env = {**os.environ, "ACCELERATE_ZERO_SIMULATED_NODES": str(NODES), "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        rows += _summarise(world, json.loads(out.read_text()))
    header = "| W | layout | between nodes MB/step | formula MB | ratio | flat / this | s/step | held MB (rank 0) | max loss gap |"
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        vs_flat = f"{r['vs_flat']:.2f}x" if r["vs_flat"] else "-"
        print(
            f"| {r['world']} | {r['layout']} | {r['between_nodes_MB_per_step']:.2f} | {r['formula_MB']:.2f} | "
            f"{r['ratio']:.4f} | {vs_flat} | {r['seconds_per_step']:.3f} | {r['held_MB_rank0']:.1f} | "
            f"{r['max_loss_gap']:.2e} |"
        )
    print(f"parameters: {rows[0]['parameters']:,}")
    control = max(r["control_bytes_per_step"] for r in rows)
    print(f"other bytes between nodes (gradient norm, step checks): at most {control:.0f} per step")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
