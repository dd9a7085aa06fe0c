"""One GPU, stage 3 in bf16: device memory per phase and time per step under each offload mode, against the
estimator's prediction; and the offloaded step on one thread against the rank's cores (issue 30; bench/README.md,
"On a GPU: tests/gpu/smoke.py and gpu_offload.py").

Usage (on a machine with one CUDA GPU, from the repository root):
    python bench/gpu_offload.py --json out/gpu_offload.json                 # the default model, every mode
    python bench/gpu_offload.py --hidden 2048 --layers 24 --modes none cpu   # another size, some modes
    python bench/gpu_offload.py --hidden 4096 --batch 2 --largest            # the estimator's largest model per mode

The Llama is written once as a bf16 checkpoint; each mode runs in a fresh process (clean allocator statistics) as a
user runs it: `accelerate_zero.from_pretrained`, `initialize`, `--steps` steps, OMP_NUM_THREADS=1 as launchers set
it; `cpu/1 thread` repeats cpu with ACCELERATE_ZERO_HOST_THREADS=1. The last lines are a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import launch, models, report


MODES = ("none", "cpu", "cpu+param", "nvme")


def llama_config(hidden: int, layers: int, seq: int) -> Any:
    """Intermediate 8/3 x hidden rounded to 256, heads of 128 dimensions."""
    return models.llama_config(
        hidden, layers, intermediate=256 * round(hidden * 8 / 3 / 256), heads=hidden // 128, seq=seq
    )


def zero_config(mode: str, nvme_dir: str, batch: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3}
    if mode != "none":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir} if mode == "nvme" else {"device": "cpu"}
    if mode in ("cpu+param", "nvme"):
        zero["offload_param"] = (
            {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0} if mode == "nvme" else {"device": "cpu"}
        )
    return {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": batch,
            "zero_optimization": zero}  # fmt: skip


def estimate(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The estimator's memory (device, host, disk) and activation bytes for this run, and the parameter count."""
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug import estimate as est

    config = llama_config(args.hidden, args.layers, args.seq)
    zero = ZeroConfig.from_any(zero_config(mode, args.nvme_dir, args.batch)).zero_optimization
    architecture = est.Architecture(hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                                    num_heads=config.num_attention_heads, vocab_size=config.vocab_size)  # fmt: skip
    shapes = est.shapes_from_module(models.llama(config, device="meta"), zero, architecture=architecture)
    memory = est.estimate_stage(shapes, est.TrainingSetup(world_size=1, mixed_precision="bf16", zero=zero), 3, mode)
    activations = est.activation_bytes(architecture, micro_batch=args.batch, seq_len=args.seq, compute_bytes=2)
    return {"memory": memory, "activations": activations, "numel": shapes.numel}


def largest(args: argparse.Namespace) -> None:
    """Prints, per mode, the most layers (at `--hidden`) the estimator says fit 90% of the GPU, 95% of the RAM and
    `--disk_gb` of disk, and the bytes each place would hold."""
    from accelerate_zero.debug import estimate as est

    gib = 2**30
    budget = est.Budget(int(args.gpu_gib * gib * 0.9), int(args.cpu_gib * gib * 0.95), int(args.disk_gb * 1e9))
    for mode in MODES:
        fitting, low, high = None, 1, 400
        while low <= high:
            args.layers = (low + high) // 2
            predicted = estimate(args, mode)
            if est.fits(predicted["memory"], predicted["activations"], budget):
                fitting, low = (args.layers, predicted), args.layers + 1
            else:
                high = args.layers - 1
        if fitting is None:
            print(f"{mode}: no layer count fits")
            continue
        layers, predicted = fitting
        memory = predicted["memory"]
        device = (memory.device["total"] + predicted["activations"]) / gib
        print(f"{mode}: {layers} layers, {predicted['numel'] / 1e9:.2f}B parameters; device {device:.1f} GiB, host "
              f"{memory.host['total'] / gib:.1f} GiB, disk {memory.nvme['total'] / 1e9:.1f} GB")  # fmt: skip


def train_mode(mode: str, checkpoint: str, nvme_dir: str, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """Rank function (one process): load partitioned, initialize, train; device peak per phase (0 on the CPU)."""
    import torch
    from transformers import LlamaForCausalLM

    import accelerate_zero

    cuda = torch.cuda.is_available()  # the CPU runs the same code with nothing to read (a dry run of the script)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    config, phases, start = zero_config(mode, nvme_dir, batch), {}, time.perf_counter()

    def mark(phase: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            phases[phase] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            phases[phase] = 0.0
        print({"phase": phase, "seconds": round(time.perf_counter() - start, 1), **phases}, file=sys.stderr)

    model = accelerate_zero.from_pretrained(LlamaForCausalLM, checkpoint, config=config, device=device)
    mark("load")
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5), config=config)
    mark("init")
    setup_seconds, tokens, times = time.perf_counter() - start, models.tokens(batch, seq, 32000, seed=0).to(device), []
    for _ in range(steps):
        begin = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        mark("forward")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("step")
        times.append(time.perf_counter() - begin)
    breakdown, threads = engine.memory_breakdown(), getattr(engine.sharded_optimizer.host_threads, "threads", None)
    engine.destroy()
    return {"host_threads": threads, "peak_gib": phases, "setup_seconds": round(setup_seconds, 1),
            "step_seconds": round(statistics.median(times[1:]), 3) if steps > 1 else None,
            "loss": float(loss.detach().float()),
            "rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "engine_device_gib": round(breakdown["total"] / 2**30, 3),
            "engine_host_gib": round(breakdown["host_total"] / 2**30, 3)}  # fmt: skip


def run_mode(args: argparse.Namespace, mode: str, threads: str | None) -> dict[str, Any]:
    kwargs = dict(
        mode=mode, checkpoint=args.checkpoint, nvme_dir=args.nvme_dir, batch=args.batch, seq=args.seq, steps=args.steps
    )
    env = {} if threads is None else {"ACCELERATE_ZERO_HOST_THREADS": threads}
    try:
        result = launch.on_ranks(1, train_mode, kwargs, name=mode.replace("+", "_"), env=env, timeout=args.timeout,
                                 backend="none").results[0]  # fmt: skip
    except launch.LaunchFailed as failed:  # what it reached is at the end of its log
        return {"error": str(failed)[-3000:]}
    predicted = estimate(args, mode)
    measured = max(result["peak_gib"].values()) * 2**30
    memory = {"device": predicted["memory"].device["total"], "activations": predicted["activations"],
              "host": predicted["memory"].host["total"]}  # fmt: skip
    result["numel"], result["estimate_gib"] = predicted["numel"], {k: round(v / 2**30, 3) for k, v in memory.items()}
    total = memory["device"] + memory["activations"]
    result["estimate_over_measured"] = round(total / measured, 3) if measured else None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=[*MODES, "cpu/1 thread"])
    parser.add_argument("--nvme_dir", default=None, help="a folder on a local disk (default: a temporary one)")
    parser.add_argument("--checkpoint", default=None, help="where the model is written (default: temporary)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mode")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--largest", action="store_true", help="print the estimator's largest model per mode")
    parser.add_argument("--gpu_gib", type=float, default=79.6, help="for --largest: GPU memory")
    parser.add_argument("--cpu_gib", type=float, default=125.0, help="for --largest: RAM")
    parser.add_argument("--disk_gb", type=float, default=64.0, help="for --largest: free disk for NVMe offload")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="gpu_offload_")
    args.nvme_dir = args.nvme_dir or f"{scratch}/nvme"
    if args.largest:
        largest(args)
        return 0
    import torch

    facts = report.machine_facts()
    args.checkpoint = args.checkpoint or f"{scratch}/model"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models.llama(
        llama_config(args.hidden, args.layers, args.seq), device=device, dtype=torch.bfloat16
    ).save_pretrained(args.checkpoint)
    results = []
    for mode in args.modes:
        name, _, threads = mode.partition("/")
        results.append(dict(run_mode(args, name, "1" if threads else None), mode=mode))
        print(json.dumps(results[-1]), flush=True)
    numel = next((r["numel"] for r in results if "numel" in r), 0)
    title = (f"gpu_offload: Llama hidden {args.hidden} x {args.layers} layers ({numel / 1e9:.2f}B parameters), bf16, "
             f"stage 3, batch {args.batch} x {args.seq} tokens, 1 rank")  # fmt: skip
    print(report.header(facts, title))
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["mode"], f"error: {r['error'][-200:]!r}", *[""] * 6))
            continue
        phase = max(r["peak_gib"], key=r["peak_gib"].get)
        estimated = r["estimate_gib"]["device"] + r["estimate_gib"]["activations"]
        rows.append(
            (
                r["mode"],
                r["host_threads"],
                r["step_seconds"],
                f"{r['peak_gib'][phase]} ({phase})",
                f"{estimated:.2f}",
                r["estimate_over_measured"],
                r["engine_host_gib"],
                r["rss_peak_gib"],
            )
        )
    columns = [
        "mode",
        "threads",
        "step s",
        "peak GiB (phase)",
        "estimate GiB",
        "est./meas.",
        "engine host GiB",
        "RSS GiB",
    ]
    print(report.table(columns, rows, "l" * 8))
    if args.json is not None:
        report.save_json(args.json, {"args": vars(args), "results": results}, facts)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
