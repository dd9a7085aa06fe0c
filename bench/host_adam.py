"""Host AdamW throughput: our offloaded optimizer step against DeepSpeed's compiled cpu_adam and torch's variants
(bench/README.md, "Host AdamW throughput", says what each implementation is and how it is timed and checked).

Usage:
    .venv/bin/python bench/host_adam.py --threads 1 2 --json bench/out/host_adam.json       # what issue 30 reports
    .venv/bin/python bench/host_adam.py --impl ours deepspeed --threads 1 --numel 10000000

Each (implementation, thread count, repeat) runs in a fresh process with OMP_NUM_THREADS and MKL_NUM_THREADS set,
repeats interleaved; each implementation's parameters after 3 steps must match torch-for-loop's to 1e-6 of their
largest magnitude.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import launch, report


IMPLS = ("torch-fused", "torch-foreach", "torch-for-loop", "ours", "deepspeed")
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CHECK_STEPS = 3
RTOL = 1e-6


def split_sizes(numel: int, tensors: int) -> list[int]:
    """Uneven sizes, most not a multiple of a SIMD width, so the kernels' tail paths run too."""
    base = numel // tensors
    sizes = [base - 3 * i - 1 for i in range(tensors - 1)]
    return sizes + [numel - sum(sizes)]


def make_problem(numel: int, tensors: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Parameters as views of one flat buffer (as the engine's host master shard), and the flat gradient buffer
    whose views are their grads."""
    flat, grad_flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed)), torch.empty(numel)
    params = []
    for p, g in zip(
        flat.split(split_sizes(numel, tensors)), grad_flat.split(split_sizes(numel, tensors)), strict=True
    ):
        p.grad = g  # a view: each step's gradients are written into grad_flat
        params.append(p)
    return params, grad_flat


def build_optimizer(impl: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer `impl` names, over `params`, with the same hyperparameters for all."""
    if impl in ("torch-fused", "torch-foreach", "torch-for-loop"):
        return torch.optim.AdamW(params, fused=impl == "torch-fused", foreach=impl == "torch-foreach", **HYPER)
    if impl == "ours":
        from accelerate_zero.offload.policy import use_fused_cpu_step  # not in DeepSpeed's virtualenv

        optimizer = torch.optim.AdamW(params, **HYPER)  # what a user writes
        use_fused_cpu_step(optimizer, force_fast=True)  # what the engine does (engine/assemble.py)
        assert all(g["fused"] for g in optimizer.param_groups), "ours did not switch to the fused kernel"
        return optimizer
    if impl == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (user, nice, system, irq, softirq) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    return (sum(fields[:3]) + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def check_run(impl: str, numel: int, tensors: int) -> list[torch.Tensor]:
    """The parameters after CHECK_STEPS steps from one seed, a new gradient each step."""
    params, grad_flat = make_problem(numel, tensors, seed=2)
    optimizer = build_optimizer(impl, params)
    for step in range(CHECK_STEPS):
        grad_flat.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(100 + step)))
        optimizer.step()
    return [p.detach().clone() for p in params]


def measure(impl: str, numel: int, tensors: int, warmup: int, steps: int, check_numel: int, check_out: str) -> dict:
    """Rank function (one process): `steps` timed steps after `warmup`, then the correctness run into `check_out`."""
    params, grad_flat = make_problem(numel, tensors, seed=0)
    grad_flat.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(1)))
    optimizer = build_optimizer(impl, params)
    wall, cpu = [], []
    for i in range(warmup + steps):
        if i == warmup:
            busy0, own0, wall0 = busy_seconds(), time.process_time(), time.perf_counter()
        w0, c0 = time.perf_counter(), time.process_time()
        optimizer.step()
        if i >= warmup:
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    # Other processes' CPU use during the timed steps, in cores: /proc/stat counts 10 ms ticks, so a window under
    # 0.2 s gives no reading.
    window, others = time.perf_counter() - wall0, None
    if window >= 0.2:
        others = max(0.0, (busy_seconds() - busy0 - (time.process_time() - own0)) / window)
    del optimizer, params, grad_flat
    torch.save(check_run(impl, check_numel, tensors), check_out)
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if impl == "deepspeed":
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "other_cores": others,
        "threads": torch.get_num_threads(),
        "versions": versions,
    }


def check(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Max abs difference to torch-for-loop's parameters (computed here) after CHECK_STEPS steps, per run."""
    ref = check_run("torch-for-loop", args.check_numel, args.tensors)
    scale = max(t.abs().max().item() for t in ref)
    for r in results:
        got = torch.load(r.pop("check_params"))
        r["max_abs_diff"] = diff = max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
        r["max_rel_diff"] = diff / scale
        assert diff <= RTOL * scale, f"{r['impl']} x{r['threads']}: max |p - p_ref| {diff:.3g} > {RTOL} * {scale:.3g}"


def table(args: argparse.Namespace, results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """One row per (implementation, threads), pooling its repeats: the summary rows and their markdown table."""
    rows, lines = [], []
    for impl in args.impl:
        for threads in args.threads:
            runs = [r for r in results if r["impl"] == impl and r["threads"] == threads]
            if not runs:
                continue
            medians = [statistics.median(r["wall_s"]) for r in runs]
            pooled = statistics.median([t for r in runs for t in r["wall_s"]])
            row = {"impl": impl, "threads": threads, "s_per_step": pooled, "run_medians_s": medians,
                   "runs_spread": max(medians) / min(medians) - 1, "mparams_per_s": args.numel / pooled / 1e6,
                   "cpu_s_per_step": statistics.median([t for r in runs for t in r["cpu_s"]]),
                   "other_cores": [r["other_cores"] for r in runs],
                   "max_abs_diff": max(r["max_abs_diff"] for r in runs),
                   "max_rel_diff": max(r["max_rel_diff"] for r in runs)}  # fmt: skip
            rows.append(row)
            spread = " (>10% apart)" if row["runs_spread"] > 0.10 else ""
            others = " / ".join("n/a" if o is None else f"{o:.2f}" for o in row["other_cores"])
            lines.append((impl, threads, f"{pooled:.4g}", f"{row['mparams_per_s']:.0f}",
                          f"{row['mparams_per_s'] / threads:.0f}", " / ".join(f"{m:.4g}" for m in medians) + spread,
                          f"{row['cpu_s_per_step']:.4g}", others, f"{row['max_abs_diff']:.2g}"))  # fmt: skip
    columns = ["impl", "threads", "s/step", "Mparams/s", "Mparams/s/thread", "run medians (s)", "CPU s/step",
               "other load (cores)", "max abs diff"]  # fmt: skip
    return rows, report.table(columns, lines, "lrrrrlrlr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--check_numel", type=int, default=1_000_003)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (>= 5); 20 gives the other-load reading")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per (impl, threads), interleaved")
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV, help="DeepSpeed's own virtualenv")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps must be at least 5")
    ds_python = launch.deepspeed_python(args.ds_venv)
    if "deepspeed" in args.impl and ds_python is None:
        print(f"no DeepSpeed virtualenv at {args.ds_venv} (see harness/launch.py): skipping deepspeed")
        args.impl = [i for i in args.impl if i != "deepspeed"]
    facts = report.machine_facts()
    print(report.header(facts, f"host_adam: {args.numel:,} fp32 parameters in {args.tensors} tensors"))
    results = []
    with tempfile.TemporaryDirectory(prefix="host_adam_") as tmp:
        for repeat in range(args.repeats):
            for impl in args.impl:
                for threads in args.threads:
                    tag = f"{impl}_{threads}_{repeat}"
                    kwargs = dict(
                        impl=impl,
                        numel=args.numel,
                        tensors=args.tensors,
                        warmup=args.warmup,
                        steps=args.steps,
                        check_numel=args.check_numel,
                        check_out=f"{tmp}/{tag}.pt",
                    )
                    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}  # DeepSpeed's OpenMP
                    python = ds_python if impl == "deepspeed" else None
                    r = launch.on_ranks(1, measure, kwargs, name=tag, python=python, env=env, threads=threads,
                                        backend="none").results[0]  # fmt: skip
                    results.append(
                        dict(r, impl=impl, threads=threads, repeat=repeat, check_params=kwargs["check_out"])
                    )
                    print(
                        f"  #{repeat} {impl:15s} x{threads}: {statistics.median(r['wall_s']):.4g} s/step", flush=True
                    )
        check(args, results)
    rows, text = table(args, results)
    print(text)
    print(f"correctness: all within {RTOL} * max|p_ref| of torch-for-loop after {CHECK_STEPS} steps (last column)")
    if args.json:
        report.save_json(
            args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "runs": results}, facts
        )


if __name__ == "__main__":
    main()
