"""Eager against torch.compile: ours at stages 0-3, DDP and FSDP2, all in the same ranks per world size (issue 51;
bench/README.md, "compile_bench.py").
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from harness import cli, launch, models, report


FAMILIES = ("ours0", "ours1", "ours2", "ours3", "ddp", "fsdp2")


def _build(name: str, size: dict[str, int], backend: str, device: Any) -> Callable[[Any], None]:
    """A step function of system `name` (a family, "+compile" for the compiled one) on its own copy of the Llama."""
    import torch

    family, compiled = name.removesuffix("+compile"), name.endswith("+compile")
    hidden = size["hidden"]
    config = models.llama_config(hidden, size["layers"], vocab=size["vocab"], heads=max(1, hidden // 64),
                                 intermediate=hidden * 8 // 3, seq=size["seq"], use_cache=False)  # fmt: skip
    model = models.llama(config)
    if family.startswith("ours"):
        import accelerate_zero

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ds = {"train_micro_batch_size_per_gpu": size["batch"], "zero_optimization": {"stage": int(family[-1])}}
        engine = accelerate_zero.initialize(model, optimizer, ds, device=device)
        if compiled:
            engine.compile(backend=backend)  # stages 0-2 the whole model, stage 3 each decoder layer

        def engine_step(tokens: torch.Tensor) -> None:
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()

        return engine_step
    model = model.to(device)
    if family == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        call = torch.compile(wrapped, backend=backend) if compiled else wrapped
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:  # torchtitan's per-block recipe: FSDP2's hooks stay outside the graphs
            if compiled:
                layer.compile(backend=backend)
            fully_shard(layer)
        call = fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor) -> None:
        call(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def time_systems(systems: list[str], size: dict[str, int], backend: str, cuda: bool, rounds: int, steps: int,
                 warmup: int) -> dict[str, Any]:  # fmt: skip
    """Rank function: every system eager and compiled, warmed up (compilation happens there), then `rounds` rounds
    of `steps` steps of each in turn, reversed every other round; each step after a barrier. Rank 0's CPU time
    (`time.process_time`, every thread) and wall time per step, the load average per system and round."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # FSDP2's default mesh and NCCL use the current device
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    names = [f"{family}{suffix}" for family in systems for suffix in ("", "+compile")]
    tokens = models.tokens(size["batch"], size["seq"], size["vocab"], seed=dist.get_rank()).to(device)
    step_of, warmup_seconds = {}, {}
    for name in names:
        start = time.perf_counter()
        step_of[name] = _build(name, size, backend, device)
        for _ in range(warmup):
            step_of[name](tokens)
        warmup_seconds[name] = time.perf_counter() - start
    readings: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": [], "load": []} for n in names}
    for _, name in launch.interleaved(names, rounds):
        readings[name]["load"].append(os.getloadavg()[0])
        for _ in range(steps):
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            step_of[name](tokens)
            if cuda:
                torch.cuda.synchronize(device)
            readings[name]["cpu"].append(time.process_time() - cpu)
            readings[name]["wall"].append(time.perf_counter() - wall)
    dist.destroy_process_group()
    return {"readings": readings, "warmup_seconds": warmup_seconds}


def _table(result: dict[str, Any]) -> str:
    """Per system, rank 0's medians (ms per step); then compile's speedup per family and ours3+compile against
    fsdp2+compile (the issue's goal)."""
    readings, medians, rows = result["readings"], {}, []
    for name, reading in readings.items():
        medians[name] = {kind: statistics.median(reading[kind]) * 1e3 for kind in ("cpu", "wall")}
        rows.append(
            (
                name,
                f"{medians[name]['cpu']:.1f}",
                f"{medians[name]['wall']:.1f}",
                f"{result['warmup_seconds'][name]:.0f}",
                " ".join(f"{v:.1f}" for v in reading["load"]),
            )
        )
    pairs = [(f"compile's speedup, {name}", name, f"{name}+compile") for name in readings if "+" not in name]
    pairs.append(("ours3+compile / fsdp2+compile (goal <= 1.10)", "ours3+compile", "fsdp2+compile"))
    rows += [(label, *(f"{medians[a][kind] / medians[b][kind]:.2f}" for kind in ("cpu", "wall")), "", "")
             for label, a, b in pairs if a in medians and b in medians]  # fmt: skip
    columns = [
        "system (ms per step, median on rank 0; then ratios)",
        "CPU",
        "wall",
        "warm-up incl. compile (s)",
        "load",
    ]
    return report.table(columns, rows)


def compile_bench(
    world_sizes: tuple[int, ...] = (2, 4),
    systems: tuple[str, ...] = FAMILIES,
    rounds: int = 3,
    steps: int = 5,
    warmup: int = 3,
    hidden: int = 256,
    layers: int = 4,
    vocab: int = 4096,
    seq: int = 128,
    batch: int = 2,
    backend: str = "inductor",
    device: str = "cpu",
) -> cli.Answer:
    """Each system trains its own copy of one LlamaForCausalLM (fp32, untied, AdamW, clipping 1.0) on fixed random
    rows, eager and compiled: ours by `engine.compile()`, DDP as `torch.compile(ddp_model)`, FSDP2 by each decoder
    layer's `module.compile()` before `fully_shard`.

    Args:
        world_sizes: one group of ranks per world size, every system in it.
        systems: families; each runs eager and compiled.
        rounds: interleaved rounds.
        steps: timed steps per system and round.
        warmup: untimed steps per system first (compilation happens there).
        hidden: the Llama's width (heads of 64).
        layers: its decoder layers.
        vocab: its vocabulary.
        seq: tokens per row.
        batch: rows per rank.
        backend: torch.compile's backend.
        device: cpu (gloo) or cuda (NCCL, one GPU per rank).
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "az_compile_bench_cache"))
    size = {"hidden": hidden, "layers": layers, "vocab": vocab, "seq": seq, "batch": batch}
    results, text = {}, []
    for world_size in world_sizes:
        kwargs = dict(systems=list(systems), size=size, backend=backend, cuda=device == "cuda", rounds=rounds,
                      steps=steps, warmup=warmup)  # fmt: skip
        results[world_size] = launch.on_ranks(world_size, time_systems, kwargs, name=f"w{world_size}", backend="none",
                                              timeout=3600).results[0]  # fmt: skip
        text.append(f"W = {world_size}\n\n{_table(results[world_size])}")
    title = (f"compile_bench: Llama hidden {hidden}, {layers} layers, vocabulary {vocab}, {batch} x {seq} tokens per "
             f"rank, fp32, AdamW; {backend} on {device}")  # fmt: skip
    return cli.Answer(title, "\n\n".join(text), results)


if __name__ == "__main__":
    sys.exit(cli.main(compile_bench, choices={"systems": FAMILIES, "device": ("cpu", "cuda")}))
