"""Offload: step time of each mode against no offload, and the largest model each system trains in a RAM budget
(bench/README.md, "offload_bench.py", says what each part runs and reads).

Usage:
    .venv/bin/python bench/offload_bench.py                         # both parts; budget 24 GiB (this machine)
    .venv/bin/python bench/offload_bench.py --ram_budget_gb 4       # the largest-model search within 4 GiB
    .venv/bin/python bench/offload_bench.py --part step_time --steps 12
    .venv/bin/python bench/offload_bench.py --part largest --ram_budget_gb 4 --systems ddp az3_nvme
    .venv/bin/python bench/offload_bench.py --from_json bench/out/offload.json   # print a saved run again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import launch, report


BENCH_DIR = Path(__file__).resolve().parent
GIB = 1024**3
LADDER_LLAMA = dict(vocab=1024, intermediate=2816, heads=8, seq=128)
"""The largest-model part's LlamaForCausalLM at hidden 1024 (12.85M parameters per decoder layer)."""
LADDER = [1, 2, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96]
LEAN_STAGE3 = {
    "stage3_prefetch_bucket_size": 13_000_000,
    "stage3_max_live_parameters": 26_000_000,
    "stage3_max_reuse_distance": 0,
}
"""Largest-model part, ZeRO systems: gather one decoder layer ahead, at most two live, release each after use (what
a user picks to fit the largest model; DeepSpeed's defaults keep up to 1e9 parameters gathered)."""
LARGEST_SYSTEMS = ["ddp", "az3", "az3_cpu", "az3_nvme"]
STEP_MODES = {
    2: ["none", "opt_cpu", "opt_nvme"],
    3: ["none", "opt_cpu", "opt_param_cpu", "opt_nvme", "opt_param_nvme"],
}
MODE_LABEL = {
    "none": "no offload",
    "opt_cpu": "optimizer cpu",
    "opt_param_cpu": "optimizer + param cpu",
    "opt_nvme": "optimizer nvme",
    "opt_param_nvme": "optimizer + param nvme",
}


def ladder_llama(layers: int) -> Any:
    from harness import models

    return models.llama_config(1024, layers, **LADDER_LLAMA)


def zero_config(stage: int, mode: str, nvme_dir: str) -> dict[str, Any]:
    """The DeepSpeed-format config of one offload mode."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if mode.startswith("opt_"):
        nvme = mode.endswith("nvme")
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir} if nvme else {"device": "cpu"}
        zero["sub_group_size"] = 4_000_000
    if mode == "opt_param_cpu":
        zero["offload_param"] = {"device": "cpu"}
    if mode == "opt_param_nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "zero_optimization": zero}


# ------------------------------------------------------------------------------------------------ rank side
def step_times(stage: int, layers: int, hidden: int, steps: int, nvme_dir: str) -> dict[str, list[float]]:
    """Rank function: every mode of `stage` in turn on the Linear stack, no offload again last; seconds per step."""
    import torch
    import torch.distributed as dist
    from harness import models
    from torch import nn

    import accelerate_zero

    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(8, hidden), torch.randn(8, hidden)
    results: dict[str, list[float]] = {}
    for mode in [*STEP_MODES[stage], "none"]:
        model = models.build_model(hidden, layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = accelerate_zero.initialize(model, optimizer, config=zero_config(stage, mode, nvme_dir))
        times = []
        for step in range(2 + steps):
            dist.barrier()
            start = time.perf_counter()
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            dist.barrier()
            if step >= 2:
                times.append(time.perf_counter() - start)
        results[mode if mode not in results else "none_again"] = times
        engine.destroy()
    return results


def largest_point(system: str, layers: int, checkpoint: str, nvme_dir: str) -> dict[str, float]:
    """Rank function: 3 steps of one ladder point; this rank's baseline and peak RSS (VmHWM)."""
    import torch
    import torch.distributed as dist
    from harness import models
    from harness.readings import proc_status

    import accelerate_zero

    baseline = proc_status()["VmRSS"]
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(models.llama(ladder_llama(layers)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train_step(ids: torch.Tensor) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        from transformers import LlamaForCausalLM

        mode = {"az3": "none", "az3_cpu": "opt_param_cpu", "az3_nvme": "opt_param_nvme"}[system]
        config = zero_config(3, mode, nvme_dir)
        config["train_micro_batch_size_per_gpu"] = 2
        config["zero_optimization"].update(LEAN_STAGE3)
        model = accelerate_zero.from_pretrained(LlamaForCausalLM, checkpoint, config=config)
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)

        def train_step(ids: torch.Tensor) -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    start = time.perf_counter()
    for step in range(3):
        train_step(models.tokens(2, 64, LADDER_LLAMA["vocab"], seed=1000 * step + dist.get_rank()))
    seconds = time.perf_counter() - start
    return {"baseline_rss": baseline, "peak_rss": proc_status()["VmHWM"], "seconds_3_steps": seconds}


# ---------------------------------------------------------------------------------------------- driver side
def step_time_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for stage in args.stages:
        kwargs = dict(
            stage=stage, layers=args.layers, hidden=args.hidden, steps=args.steps, nvme_dir=str(args.nvme_dir)
        )
        try:
            times = launch.on_ranks(2, step_times, kwargs, name=f"step_time_stage{stage}").results[0]
        except launch.LaunchFailed as failed:
            rows.append({"stage": stage, "mode": "all", "status": f"failed ({failed.code})"})
            continue
        nones = [statistics.median(times["none"]), statistics.median(times["none_again"])]
        for mode in STEP_MODES[stage]:
            median = statistics.median(times[mode])
            rows.append({"stage": stage, "mode": mode, "median_step_s": median, "steps": len(times[mode]),
                         "ratio_to_none": 2 * median / sum(nones), "none_medians_s": nones})  # fmt: skip
    return rows


def write_checkpoint(folder: Path, ladder: list[int]) -> tuple[int, int]:
    """Writes the ladder's Llama one tensor at a time (one safetensors file per layer), then per ladder point a
    folder `L<n>` whose index names only the files of its first n layers (so no process builds the whole model).

    Returns:
        (parameters outside the decoder layers, parameters per decoder layer).
    """
    import torch
    from harness import models
    from safetensors.torch import save_file

    shards, max_layers = folder / "shards", max(ladder)
    shards.mkdir(parents=True, exist_ok=True)
    meta = models.llama(ladder_llama(max_layers), device="meta")
    generator = torch.Generator().manual_seed(0)
    by_file: dict[str, dict[str, torch.Size]] = {}
    for name, param in meta.named_parameters():
        parts = name.split(".")
        file = f"layer{int(parts[2]):05d}.safetensors" if parts[1] == "layers" else "outer.safetensors"
        by_file.setdefault(file, {})[name] = param.shape
    for file, shapes in by_file.items():
        if not (shards / file).exists():
            tensors = {
                name: torch.ones(shape)
                if name.endswith("norm.weight")
                else torch.randn(shape, generator=generator) * 0.02
                for name, shape in shapes.items()
            }
            save_file(tensors, str(shards / file), metadata={"format": "pt"})
    for layers in sorted(set(ladder)):
        point = folder / f"L{layers}"
        point.mkdir(exist_ok=True)
        ladder_llama(layers).save_pretrained(point)
        weight_map = {}
        for file, shapes in by_file.items():
            if file == "outer.safetensors" or int(file[5:10]) < layers:
                weight_map.update(dict.fromkeys(shapes, file))
                if not (point / file).exists():
                    (point / file).symlink_to(shards / file)
        (point / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    per_layer = sum(p.numel() for p in meta.model.layers[0].parameters())
    return sum(p.numel() for p in meta.parameters()) - max_layers * per_layer, per_layer


def largest_part(args: argparse.Namespace) -> dict[str, Any]:
    """Each system climbs the ladder until its first point whose ranks' peak RSS sum is over the budget (a watchdog
    kills a point as soon as the live sum is over it, so no run takes more than the budget)."""
    budget = args.ram_budget_gb * GIB
    ladder = [n for n in (args.ladder or LADDER) if n <= args.max_layers]
    outer, per_layer = write_checkpoint(args.nvme_dir / "checkpoint", ladder)
    out: dict[str, Any] = {"ram_budget_gb": args.ram_budget_gb, "points": [], "largest": {}}
    for system in args.systems:
        largest = None
        for layers in ladder:
            params, swap = outer + layers * per_layer, args.nvme_dir / f"swap_{system}_{layers}"
            point: dict[str, Any] = {"system": system, "layers": layers, "params": params}
            print(f"largest: {system} with {layers} layers ({params / 1e6:.0f}M parameters)", file=sys.stderr)
            kwargs = dict(system=system, layers=layers, checkpoint=str(args.nvme_dir / "checkpoint" / f"L{layers}"),
                          nvme_dir=str(swap))  # fmt: skip
            try:
                ranks = launch.on_ranks(2, largest_point, kwargs, name=f"largest_{system}_{layers}",
                                        timeout=args.point_timeout, rss_budget=budget)  # fmt: skip
                point.update(status="ok", watchdog_max_rss_sum=ranks.peak_rss_sum)
                point["peak_rss_per_rank"] = [r["peak_rss"] for r in ranks.results]
                point["peak_rss_sum"] = sum(point["peak_rss_per_rank"])
                point["seconds_3_steps"] = max(r["seconds_3_steps"] for r in ranks.results)
                point["fits"] = point["peak_rss_sum"] <= budget
            except launch.LaunchFailed as failed:
                code = failed.code
                point.update(status=code if isinstance(code, str) else f"failed ({code})", fits=False)
                point["watchdog_max_rss_sum"] = failed.peak_rss_sum
            shutil.rmtree(swap, ignore_errors=True)
            out["points"].append(point)
            seen = point.get("peak_rss_sum", point["watchdog_max_rss_sum"])
            print(f"  {point['status']}, peak RSS sum {seen / GIB:.2f} GiB", file=sys.stderr)
            if not point["fits"]:
                break
            largest = point
        out["largest"][system] = largest
    return out


def markdown(payload: dict[str, Any]) -> str:
    lines = []
    if payload.get("step_time"):
        a = payload["args"]
        lines += [f"Step time at 2 processes, fp32 AdamW, {a['layers']} x Linear({a['hidden']}) (median of "
                  f"{a['steps']} steps; ratio to no offload in the same group)", ""]  # fmt: skip
        rows = [
            (r["stage"], MODE_LABEL[r["mode"]], f"{1000 * r['median_step_s']:.1f}", f"{r['ratio_to_none']:.2f}")
            if "median_step_s" in r
            else (r["stage"], r["mode"], r["status"], "")
            for r in payload["step_time"]
        ]
        lines += [report.table(["stage", "mode", "median step (ms)", "ratio to no offload"], rows, "llrr"), ""]
    largest = payload.get("largest")
    if largest:
        budget, ddp = largest["ram_budget_gb"], largest["largest"].get("ddp")
        lines += [f"Largest LlamaForCausalLM that trains 3 steps at 2 processes within a RAM budget of {budget:g} GiB "
                  "(sum over ranks of each rank's peak RSS, measured)", ""]  # fmt: skip
        rows = []
        for system, point in largest["largest"].items():
            failed = next((p for p in largest["points"] if p["system"] == system and not p["fits"]), None)
            over = f"{failed['params'] / 1e6:.0f}M ({failed['status']})" if failed else "none up to the ladder's top"
            if point is None:
                rows.append((system, "none", "", "", "", over))
                continue
            versus = f"{point['params'] / ddp['params']:.1f}x" if ddp else "n/a"
            per_rank = ", ".join(f"{b / GIB:.2f}" for b in point["peak_rss_per_rank"])
            rows.append((system, f"{point['params'] / 1e6:.0f}M", point["layers"], per_rank, versus, over))
        columns = ["system", "largest fitting (parameters)", "layers", "peak RSS per rank (GiB)", "vs DDP",
                   "first size that does not fit"]  # fmt: skip
        lines.append(report.table(columns, rows, "lrrlrl"))
        nvme = largest["largest"].get("az3_nvme")
        if ddp and nvme:
            factor = nvme["params"] / ddp["params"]
            verdict = "MET" if factor >= 8 else "NOT MET"
            lines += ["", f"Target (stage 3 + NVMe >= 8x DDP): {verdict} ({factor:.1f}x at {budget:g} GiB)"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["both", "step_time", "largest"], default="both")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (>= 10)")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    parser.add_argument("--layers", type=int, default=8, help="step time: Linear layers")
    parser.add_argument("--hidden", type=int, default=1024, help="step time: Linear width")
    parser.add_argument("--ram_budget_gb", type=float, default=24.0, help="largest model: RAM of the machine")
    parser.add_argument("--systems", nargs="+", default=LARGEST_SYSTEMS, choices=LARGEST_SYSTEMS)
    parser.add_argument("--max_layers", type=int, default=max(LADDER), help="largest model: top of the ladder")
    parser.add_argument("--ladder", type=int, nargs="+", help=f"largest model: layer counts, ascending ({LADDER})")
    parser.add_argument("--point_timeout", type=float, default=900, help="seconds before a ladder point is cut")
    parser.add_argument(
        "--nvme_dir", type=Path, default=Path(tempfile.gettempdir()) / "accelerate_zero_nvme_bench",
        help="a folder on the local disk to measure (default: in the system's temporary folder)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=BENCH_DIR / "out" / "offload.json")
    parser.add_argument("--from_json", type=Path, help="print the tables of a saved run")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text())))
        return
    if args.steps < 10:
        raise SystemExit(f"--steps={args.steps}: the step time is a median of at least 10 steps")
    facts = report.machine_facts()
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "command": sys.argv}
    root = args.nvme_dir
    root.mkdir(parents=True, exist_ok=True)
    args.nvme_dir = Path(tempfile.mkdtemp(prefix="offload_bench_", dir=root))  # concurrent runs do not collide
    try:
        if args.part in ("both", "step_time"):
            payload["step_time"] = step_time_part(args)
        if args.part in ("both", "largest"):
            payload["largest"] = largest_part(args)
    finally:
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when no other run uses it
    payload["markdown"] = markdown(payload)
    print(report.header(facts, "offload_bench: step time per offload mode, the largest model in a RAM budget"))
    print("\n" + payload["markdown"])
    report.save_json(args.json, payload, facts)


if __name__ == "__main__":
    main()
