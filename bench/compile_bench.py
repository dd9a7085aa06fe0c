"""Eager against torch.compile: ours at stages 0-3, DDP and FSDP2, in one process group per world size (issue 51).

Usage:
    .venv/bin/python bench/compile_bench.py                          # W=2 and 4, CPU/gloo, inductor (~25 min)
    .venv/bin/python bench/compile_bench.py --world_sizes 2 --rounds 2 --steps 3 --layers 2     # a short look
    .venv/bin/python bench/compile_bench.py --device cuda --world_sizes 1 --hidden 2048 --layers 8   # a GPU

Every system trains its own copy of one LlamaForCausalLM (random weights from a config, fp32, untied, use_cache
off) with AdamW on fixed random token rows (micro-batch `--batch` per rank, no accumulation, clipping at 1.0):
- `ours0`..`ours3`: `accelerate_zero.initialize` at that stage, DeepSpeed's defaults otherwise;
  `+compile`: `engine.compile(backend=...)` (stages 0-2 the whole model, stage 3 each decoder layer);
- `ddp`: DistributedDataParallel; `+compile`: `torch.compile(ddp_model)` (DDP's optimizer splits graphs at buckets);
- `fsdp2`: `fully_shard` on each decoder layer, then the root; `+compile`: each decoder layer's `module.compile()`
  before sharding (torchtitan's per-block recipe; FSDP2's hooks stay outside the graphs).
All systems live in the same ranks. After `--warmup` steps each (compilation happens there), `--rounds` rounds run
`--steps` steps of every system in turn, the order reversed every other round, so load from other users falls on
all of them alike. Each step starts after a barrier; recorded per step on rank 0: CPU time of the process
(`time.process_time`, all its threads) and wall time; per system and round, the load average beside them.
Reported: per system the median over all timed steps, and the ratios the issue sets goals on: each compiled system
against its eager self (compile's speedup), and ours3+compile against fsdp2+compile (goal: within 1.10x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["ours0", "ours1", "ours2", "ours3", "ddp", "fsdp2"]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--systems", nargs="+", default=FAMILIES, help="families; each runs eager and compiled")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", default=None, help="write the readings here too")
    return parser.parse_args()


def _model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _build(name: str, args: argparse.Namespace, device: Any) -> Any:
    """A step function for system `name` (a family, "+compile" for the compiled one)."""
    import torch

    family, compiled = name.removesuffix("+compile"), name.endswith("+compile")
    model = _model(args)
    if family.startswith("ours"):
        import accelerate_zero

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": int(family[-1])}}
        engine = accelerate_zero.initialize(model, optimizer, config, device=device)
        if compiled:
            engine.compile(backend=args.backend)

        def step(tokens: torch.Tensor) -> None:
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()

        return step
    model = model.to(device)
    if family == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        call = torch.compile(wrapped, backend=args.backend) if compiled else wrapped
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            if compiled:
                layer.compile(backend=args.backend)
            fully_shard(layer)
        call = fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor) -> None:
        call(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def _worker(rank: int, world_size: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # FSDP2's default mesh and NCCL use the current device
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world_size)
    names = [f"{family}{suffix}" for family in args.systems for suffix in ("", "+compile")]
    steps, compile_seconds = {}, {}
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    for name in names:
        start = time.perf_counter()
        steps[name] = _build(name, args, device)
        for _ in range(args.warmup):
            steps[name](tokens)
        compile_seconds[name] = time.perf_counter() - start
    readings: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": [], "load": []} for n in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            readings[name]["load"].append(os.getloadavg()[0])
            for _ in range(args.steps):
                dist.barrier()
                cpu, wall = time.process_time(), time.perf_counter()
                steps[name](tokens)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                readings[name]["cpu"].append(time.process_time() - cpu)
                readings[name]["wall"].append(time.perf_counter() - wall)
    if rank == 0:
        Path(out).write_text(json.dumps({"readings": readings, "warmup_seconds": compile_seconds}))
    dist.destroy_process_group()


def _run(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.json")
        mp.start_processes(_worker, (world_size, args, port, out), nprocs=world_size, start_method="spawn")
        return json.loads(Path(out).read_text())


def _table(world_size: int, result: dict[str, Any]) -> list[str]:
    readings, medians = result["readings"], {}
    lines = [f"\nW={world_size}: median per step over every timed step on rank 0 (ms); load average per round",
             "| system | CPU | wall | warm-up incl. compile (s) | load |", "|---|---|---|---|---|"]  # fmt: skip
    for name, reading in readings.items():
        medians[name] = {kind: statistics.median(reading[kind]) * 1e3 for kind in ("cpu", "wall")}
        load = " ".join(f"{value:.1f}" for value in reading["load"])
        warmup = result["warmup_seconds"][name]
        lines.append(f"| {name} | {medians[name]['cpu']:.1f} | {medians[name]['wall']:.1f} | {warmup:.0f} | {load} |")
    lines.append("| ratio | CPU | wall | | |")
    for family in dict.fromkeys(name.removesuffix("+compile") for name in readings):
        if f"{family}+compile" in medians:
            eager, compiled = medians[family], medians[f"{family}+compile"]
            speedup = {kind: eager[kind] / compiled[kind] for kind in ("cpu", "wall")}
            lines.append(f"| compile's speedup, {family} | {speedup['cpu']:.2f}x | {speedup['wall']:.2f}x | | |")
    if "ours3+compile" in medians and "fsdp2+compile" in medians:
        ours, theirs = medians["ours3+compile"], medians["fsdp2+compile"]
        ratio = {kind: ours[kind] / theirs[kind] for kind in ("cpu", "wall")}
        lines.append(
            f"| ours3+compile / fsdp2+compile (goal <= 1.10) | {ratio['cpu']:.2f} | {ratio['wall']:.2f} | | |"
        )
    return lines


def main() -> None:
    args = _parse()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "az_compile_bench_cache"))
    results = {world_size: _run(world_size, args) for world_size in args.world_sizes}
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, sequence {args.seq}, "
          f"micro-batch {args.batch} per rank, fp32, AdamW; backend {args.backend} on {args.device}")  # fmt: skip
    for world_size, result in results.items():
        print("\n".join(_table(world_size, result)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
