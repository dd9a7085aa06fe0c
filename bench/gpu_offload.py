"""One GPU, stage 3 in bf16: device memory per phase and time per step under each offload mode, against the
estimator's prediction; and the offloaded step on one thread against the rank's cores (issue 30).

Usage (on a machine with one CUDA GPU, from the repository root):
    python bench/gpu_offload.py --json out/gpu_offload.json                 # the default model, every mode
    python bench/gpu_offload.py --hidden 2048 --layers 24 --modes none cpu   # another size, some modes
    python bench/gpu_offload.py --hidden 4096 --batch 2 --largest            # the estimator's largest model per mode

A LlamaForCausalLM (`--hidden`, `--layers`, intermediate 8/3 x hidden rounded to 256, heads of 128 dimensions,
vocabulary 32000, untied head) is written once as a bf16 safetensors checkpoint, then each mode runs in a fresh
process (clean allocator statistics) the way a user runs it: `accelerate_zero.from_pretrained` (partitioned
loading: the shards go straight to their home), `accelerate_zero.initialize`, then `--steps` optimizer steps of
`--batch` x `--seq` tokens. Modes: none, cpu (offload_optimizer), cpu+param (offload_optimizer + offload_param),
nvme (both in files under --nvme_dir, `max_in_cpu: 0`); `cpu/1 thread` repeats cpu with
ACCELERATE_ZERO_HOST_THREADS=1. Every process starts with OMP_NUM_THREADS=1, as torchrun and accelerate launch set
it for several processes per node ([Note: threads for host work] in accelerate_zero/offload/host_threads.py).
Readings: `torch.cuda.max_memory_allocated` per phase (load, init, forward, backward, step), the median step time
after the first, the process's peak RSS, and the estimator (`accelerate_zero/debug/estimate.py`): model states
plus gathered parameters plus activations, and its ratio to the measured peak. The last lines are a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


MODES = ("none", "cpu", "cpu+param", "nvme")


def llama_config(hidden: int, layers: int, seq: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=256 * round(hidden * 8 / 3 / 256),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )


def zero_config(mode: str, nvme_dir: str, batch: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3}
    if mode != "none":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir} if mode == "nvme" else {"device": "cpu"}
    if mode in ("cpu+param", "nvme"):
        param = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0} if mode == "nvme" else {"device": "cpu"}
        zero["offload_param"] = param
    return {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": zero,
    }


def estimate(args: argparse.Namespace, mode: str, details: bool = False) -> dict[str, Any]:
    """The estimator's device bytes for this run (model states + gathered parameters + activations) and host bytes."""
    import torch
    from transformers import LlamaForCausalLM

    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug import estimate as est

    config = llama_config(args.hidden, args.layers, args.seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    zero = ZeroConfig.from_any(zero_config(mode, args.nvme_dir, args.batch)).zero_optimization
    architecture = est.Architecture(
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        vocab_size=config.vocab_size,
    )
    shapes = est.shapes_from_module(model, zero, architecture=architecture)
    setup = est.TrainingSetup(world_size=1, mixed_precision="bf16", zero=zero)
    memory = est.estimate_stage(shapes, setup, 3, mode)
    activations = est.activation_bytes(architecture, micro_batch=args.batch, seq_len=args.seq, compute_bytes=2)
    if details:
        return {"memory": memory, "activations": activations, "numel": shapes.numel}
    return {
        "device": memory.device["total"],
        "activations": activations,
        "host": memory.host["total"],
        "numel": shapes.numel,
    }


def largest(args: argparse.Namespace) -> None:
    """Prints, per mode, the most layers (at `--hidden`) the estimator says fit 90% of the GPU, 95% of the RAM and
    `--disk_gb` of disk, and the bytes each place would hold."""
    from accelerate_zero.debug import estimate as est

    gib = 2**30
    budget = est.Budget(int(args.gpu_gib * gib * 0.9), int(args.cpu_gib * gib * 0.95), int(args.disk_gb * 1e9))
    for mode in MODES:
        fitting, lo, hi = None, 1, 400
        while lo <= hi:
            middle = (lo + hi) // 2
            args.layers = middle
            predicted = estimate(args, mode, details=True)
            if est.fits(predicted["memory"], predicted["activations"], budget):
                fitting, lo = (middle, predicted), middle + 1
            else:
                hi = middle - 1
        if fitting is None:
            print(f"{mode}: no layer count fits")
            continue
        layers, predicted = fitting
        memory = predicted["memory"]
        print(
            f"{mode}: {layers} layers, {predicted['numel'] / 1e9:.2f}B parameters; device "
            f"{(memory.device['total'] + predicted['activations']) / gib:.1f} GiB, host {memory.host['total'] / gib:.1f} "
            f"GiB, disk {memory.nvme['total'] / 1e9:.1f} GB"
        )


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    import accelerate_zero

    cuda = torch.cuda.is_available()  # the CPU runs the same code with nothing to read (a dry run of the script)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    config = zero_config(args.mode, args.nvme_dir, args.batch)
    phases: dict[str, float] = {}

    def mark(phase: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            phases[phase] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            phases[phase] = 0.0
        print(
            json.dumps({"phase": phase, "seconds": round(time.perf_counter() - start, 1), **phases}), file=sys.stderr
        )

    start = time.perf_counter()
    model = accelerate_zero.from_pretrained(LlamaForCausalLM, args.checkpoint, config=config, device=device)
    mark("load")
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5), config=config)
    mark("init")
    setup_seconds = time.perf_counter() - start
    tokens = torch.randint(0, 32000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        mark("forward")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("step")
        times.append(time.perf_counter() - begin)
    breakdown = engine.memory_breakdown()
    threads = getattr(engine.sharded_optimizer.host_threads, "threads", None)
    engine.destroy()
    return {
        "mode": args.mode,
        "host_threads": threads,
        "peak_gib": phases,
        "step_seconds": round(statistics.median(times[1:]), 3) if len(times) > 1 else None,
        "setup_seconds": round(setup_seconds, 1),
        "loss": float(loss.detach().float()),
        "rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "engine_device_gib": round(breakdown["total"] / 2**30, 3),
        "engine_host_gib": round(breakdown["host_total"] / 2**30, 3),
    }


def write_checkpoint(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(llama_config(args.hidden, args.layers, args.seq)).to(torch.bfloat16)
    model.save_pretrained(args.checkpoint)


def run_mode(args: argparse.Namespace, mode: str, threads: str | None) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if threads is not None:
        env["ACCELERATE_ZERO_HOST_THREADS"] = threads
    command = [sys.executable, __file__, "--worker", "--mode", mode, "--checkpoint", args.checkpoint]
    command += ["--nvme_dir", args.nvme_dir, "--batch", str(args.batch), "--seq", str(args.seq)]
    command += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired as expired:  # what it reached is on its stderr
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        return {"mode": mode, "error": f"timed out after {args.timeout} s; last: {stderr[-1500:]}"}
    if done.returncode != 0:
        return {"mode": mode, "error": done.stderr[-3000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    predicted = estimate(args, mode)
    measured = max(result["peak_gib"].values()) * 2**30
    result["numel"] = predicted.pop("numel")
    result["estimate_gib"] = {k: round(v / 2**30, 3) for k, v in predicted.items()}
    total = predicted["device"] + predicted["activations"]
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.largest:
        largest(args)
        return 0
    scratch = tempfile.mkdtemp(prefix="gpu_offload_")
    args.nvme_dir = args.nvme_dir or f"{scratch}/nvme"
    args.checkpoint = args.checkpoint or f"{scratch}/model"
    write_checkpoint(args)
    results = []
    for mode in args.modes:
        name, _, threads = mode.partition("/")
        result = run_mode(args, name, "1" if threads else None)
        result["mode"] = mode
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    numel = next((r["numel"] for r in results if "numel" in r), 0)
    print(
        f"Llama hidden {args.hidden} x {args.layers} layers ({numel / 1e9:.2f}B parameters), bf16, stage 3, ", end=""
    )
    print(f"batch {args.batch} x {args.seq} tokens, 1 rank")
    print("| mode | threads | step s | peak GiB (phase) | estimate GiB | est./meas. | engine host GiB | RSS GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | error: {r['error'][-200:]!r} |")
            continue
        phase = max(r["peak_gib"], key=r["peak_gib"].get)
        est_total = r["estimate_gib"]["device"] + r["estimate_gib"]["activations"]
        print(
            f"| {r['mode']} | {r['host_threads']} | {r['step_seconds']} | {r['peak_gib'][phase]} ({phase}) | "
            f"{est_total:.2f} | {r['estimate_over_measured']} | {r['engine_host_gib']} | {r['rss_peak_gib']} |"
        )
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
