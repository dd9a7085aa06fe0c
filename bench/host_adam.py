"""Host AdamW throughput: our offloaded optimizer step against DeepSpeed's compiled cpu_adam and torch's variants.

Usage:
    .venv/bin/python bench/host_adam.py --threads 1 2 --json bench/out/host_adam.json       # what issue 30 reports
    .venv/bin/python bench/host_adam.py --impl ours deepspeed --threads 1 --numel 10000000

One AdamW step (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, fp32 parameters, gradients and both
moments) over `--numel` parameters split into `--tensors` views of one flat buffer, as the engine's host master shard
is (offload/policy.py `offload_masters`); the gradients are views of a second flat buffer. Implementations:

    torch-fused     torch.optim.AdamW(fused=True) on CPU tensors
    torch-foreach   torch.optim.AdamW(foreach=True)
    torch-for-loop  torch.optim.AdamW(foreach=False, fused=False): the per-tensor loop
    ours            the engine's path under `offload_optimizer: cpu`: the user's torch.optim.AdamW() (defaults),
                    then accelerate_zero.offload.policy.use_fused_cpu_step
    deepspeed       deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), from DeepSpeed's own virtualenv
                    (`--ds_venv`, default bench/ds_venv.py; DS_ACCELERATOR=cpu; skipped with a note when absent)

Each (implementation, thread count, repeat) runs in a fresh process with OMP_NUM_THREADS and MKL_NUM_THREADS set
(DeepSpeed's OpenMP reads them at start) and torch.set_num_threads: after `--warmup` steps, `--steps` steps are timed
one by one with perf_counter (process CPU time too); the median is reported. Repeats run interleaved (every
implementation and thread count once, then again), so drift from other load on the machine hits all of them.

Correctness: the same process also takes 3 steps from one seed (new gradients each step) on a `--check_numel`
problem split the same way and saves the parameters; each implementation must match torch-for-loop's to
max|p - p_ref| <= 1e-6 * max|p_ref| (DeepSpeed's kernel orders its operations its own way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


BENCH_DIR = Path(__file__).resolve().parent
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
    """Parameters as views of one flat buffer, and the flat gradient buffer whose views become their grads."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(numel, generator=gen)
    grad_flat = torch.empty(numel)
    params = []
    sizes = split_sizes(numel, tensors)
    for p, g in zip(flat.split(sizes), grad_flat.split(sizes), strict=True):
        p.grad = g  # a view: each step's gradients are written into grad_flat
        params.append(p)
    return params, grad_flat


def build_optimizer(impl: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer `impl` names, over `params`, with the same hyperparameters for all."""
    if impl == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **HYPER)
    if impl == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, **HYPER)
    if impl == "torch-for-loop":
        return torch.optim.AdamW(params, foreach=False, fused=False, **HYPER)
    if impl == "ours":
        # Imported here: the DeepSpeed process runs this file without accelerate_zero.
        from accelerate_zero.offload.policy import use_fused_cpu_step

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


def worker(args: argparse.Namespace) -> None:
    """One measurement in this process: timing, then the correctness run; writes JSON to --out."""
    torch.set_num_threads(args.worker_threads)
    params, grad_flat = make_problem(args.numel, args.tensors, seed=0)
    grad_flat.copy_(torch.randn(args.numel, generator=torch.Generator().manual_seed(1)))
    optimizer = build_optimizer(args.worker, params)
    wall, cpu = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            busy0, own0, wall0 = busy_seconds(), time.process_time(), time.perf_counter()
        w0, c0 = time.perf_counter(), time.process_time()
        optimizer.step()
        w1, c1 = time.perf_counter(), time.process_time()
        if i >= args.warmup:
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
    # Other processes' CPU use during the timed steps, in cores: the machine may be shared. /proc/stat counts in
    # 10 ms ticks, so a window under 0.2 s gives no reading.
    window, others = time.perf_counter() - wall0, None
    if window >= 0.2:
        others = max(0.0, (busy_seconds() - busy0 - (time.process_time() - own0)) / window)
    del optimizer, params, grad_flat

    torch.save(check_run(args.worker, args.check_numel, args.tensors), args.check_out)

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if args.worker == "deepspeed":
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    threads = torch.get_num_threads()
    result = {"wall_s": wall, "cpu_s": cpu, "other_cores": others, "threads": threads, "versions": versions}
    Path(args.out).write_text(json.dumps(result))


def measure(args: argparse.Namespace, impl: str, threads: int, tmp: Path, tag: str) -> dict[str, Any]:
    python = str(args.ds_venv / "bin" / "python") if impl == "deepspeed" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if impl == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    out, check_out = tmp / f"{tag}.json", tmp / f"{tag}.pt"
    cmd = [python, __file__, "--worker", impl, "--worker_threads", str(threads), "--out", str(out)]
    cmd += ["--check_out", str(check_out), "--numel", str(args.numel), "--tensors", str(args.tensors)]
    cmd += ["--check_numel", str(args.check_numel), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} at {threads} threads failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["check_params"] = str(check_out)
    return result


def check(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Max abs difference to torch-for-loop's parameters (computed here) after CHECK_STEPS steps, per run."""
    ref = check_run("torch-for-loop", args.check_numel, args.tensors)
    scale = max(t.abs().max().item() for t in ref)
    for r in results:
        got = torch.load(r["check_params"])
        diff = max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
        r["max_abs_diff"] = diff
        r["max_rel_diff"] = diff / scale
        assert diff <= RTOL * scale, f"{r['impl']} x{r['threads']}: max |p - p_ref| {diff:.3g} > {RTOL} * {scale:.3g}"


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for impl in args.impl:
        for threads in args.threads:
            runs = [r for r in results if r["impl"] == impl and r["threads"] == threads]
            if not runs:
                continue
            medians = [statistics.median(r["wall_s"]) for r in runs]
            pooled = statistics.median([t for r in runs for t in r["wall_s"]])
            rate = args.numel / pooled / 1e6
            rows.append(
                {
                    "impl": impl,
                    "threads": threads,
                    "s_per_step": pooled,
                    "run_medians_s": medians,
                    "runs_spread": max(medians) / min(medians) - 1,
                    "cpu_s_per_step": statistics.median([t for r in runs for t in r["cpu_s"]]),
                    "other_cores": [r["other_cores"] for r in runs],
                    "mparams_per_s": rate,
                    "mparams_per_s_per_thread": rate / threads,
                    "max_abs_diff": max(r.get("max_abs_diff", float("nan")) for r in runs),
                    "max_rel_diff": max(r.get("max_rel_diff", float("nan")) for r in runs),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| impl | threads | s/step | Mparams/s | Mparams/s/thread | run medians (s) | CPU s/step | other load "
        "(cores) | max abs diff |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        runs = " / ".join(f"{m:.4g}" for m in r["run_medians_s"])
        flag = " (>10% apart)" if r["runs_spread"] > 0.10 else ""
        others = " / ".join("n/a" if o is None else f"{o:.2f}" for o in r["other_cores"])
        lines.append(
            f"| {r['impl']} | {r['threads']} | {r['s_per_step']:.4g} | {r['mparams_per_s']:.0f} | "
            f"{r['mparams_per_s_per_thread']:.0f} | {runs}{flag} | {r['cpu_s_per_step']:.4g} | {others} | "
            f"{r['max_abs_diff']:.2g} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu if ln.startswith("Model name")), platform.processor())
    utc = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": os.getloadavg(), "utc": utc}


def parse_args() -> argparse.Namespace:
    sys.path.insert(0, str(BENCH_DIR))
    from ds_venv import DEFAULT_DS_VENV

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--check_numel", type=int, default=1_000_003)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (>= 5); 20 gives the other-load reading")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per (impl, threads), interleaved")
    parser.add_argument("--ds_venv", type=Path, default=DEFAULT_DS_VENV, help="DeepSpeed's own virtualenv")
    parser.add_argument("--json", type=Path, default=None)
    # Internal: one measurement in this process.
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--worker_threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--check_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps must be at least 5")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if "deepspeed" in args.impl and not (args.ds_venv / "bin" / "python").exists():
        print(f"no DeepSpeed virtualenv at {args.ds_venv} (see bench/ds_venv.py): skipping deepspeed")
        args.impl = [i for i in args.impl if i != "deepspeed"]
    info = machine()
    load = " ".join(f"{x:.2f}" for x in info["loadavg"])
    print(f"{info['cpu']}, {info['cores']} cores, {args.numel:,} fp32 params in {args.tensors} tensors, load {load}")
    results = []
    with tempfile.TemporaryDirectory(prefix="host_adam_") as tmp:
        for repeat in range(args.repeats):
            for impl in args.impl:
                for threads in args.threads:
                    r = measure(args, impl, threads, Path(tmp), f"{impl}_{threads}_{repeat}")
                    r.update(impl=impl, threads=threads, repeat=repeat)
                    results.append(r)
                    median = statistics.median(r["wall_s"])
                    print(f"  #{repeat} {impl:15s} x{threads}: {median:.4g} s/step", flush=True)
        check(args, results)
        for r in results:
            del r["check_params"]
    rows = summarize(args, results)
    info["loadavg_end"] = os.getloadavg()
    info["versions"] = {r["impl"]: r["versions"] for r in results}
    print(table(rows))
    print(f"correctness: all within {RTOL} * max|p_ref| of torch-for-loop after {CHECK_STEPS} steps (last column)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": info, "rows": rows, "runs": results}
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
