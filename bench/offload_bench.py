"""Offload: step time of each mode against no offload, and the largest model each system trains in a RAM budget
(bench/README.md, "offload_bench.py").
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

from harness import cli, launch, models, report


GIB = 1024**3
NVME_DIR = Path(tempfile.gettempdir()) / "accelerate_zero_nvme_bench"
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
STEP_MODES = {2: ["none", "cpu", "nvme_optimizer"], 3: ["none", "cpu", "cpu+param", "nvme_optimizer", "nvme"]}
"""`models.offload_zero`'s modes each stage has."""
MODE_LABEL = {"none": "no offload", "cpu": "optimizer cpu", "cpu+param": "optimizer + param cpu",
              "nvme_optimizer": "optimizer nvme", "nvme": "optimizer + param nvme"}  # fmt: skip


def ladder_llama(layers: int) -> Any:
    return models.llama_config(1024, layers, **LADDER_LLAMA)


def zero_config(stage: int, mode: str, nvme_dir: str) -> dict[str, Any]:
    """The DeepSpeed-format config of one offload mode."""
    zero: dict[str, Any] = {"stage": stage, **models.offload_zero(mode, nvme_dir)}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if mode != "none":
        zero["sub_group_size"] = 4_000_000
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "zero_optimization": zero}


# ------------------------------------------------------------------------------------------------ rank side
def step_times(stage: int, layers: int, hidden: int, steps: int, nvme_dir: str) -> dict[str, list[float]]:
    """Rank function: every mode of `stage` in turn on the Linear stack, no offload again last; seconds per step."""
    import torch
    import torch.distributed as dist
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

        mode = {"az3": "none", "az3_cpu": "cpu+param", "az3_nvme": "nvme"}[system]
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
            random = lambda shape: 0.02 * torch.randn(shape, generator=generator)  # noqa: E731
            tensors = {
                n: torch.ones(shape) if n.endswith("norm.weight") else random(shape) for n, shape in shapes.items()
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
                per_rank = [r["peak_rss"] for r in ranks.results]
                point.update(status="ok", watchdog_max_rss_sum=ranks.peak_rss_sum, peak_rss_per_rank=per_rank,
                             peak_rss_sum=sum(per_rank), fits=sum(per_rank) <= budget,
                             seconds_3_steps=max(r["seconds_3_steps"] for r in ranks.results))  # fmt: skip
            except launch.LaunchFailed as failed:
                code = failed.code
                point.update(status=code if isinstance(code, str) else f"failed ({code})", fits=False,
                             watchdog_max_rss_sum=failed.peak_rss_sum)  # fmt: skip
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
        rows = [(r["stage"], MODE_LABEL[r["mode"]], f"{1000 * r['median_step_s']:.1f}", f"{r['ratio_to_none']:.2f}")
                if "median_step_s" in r else (r["stage"], r["mode"], r["status"], "")
                for r in payload["step_time"]]  # fmt: skip
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


def offload_bench(
    part: str = "both",
    steps: int = 12,
    stages: tuple[int, ...] = (3, 2),
    layers: int = 8,
    hidden: int = 1024,
    ram_budget_gb: float = 24.0,
    systems: tuple[str, ...] = tuple(LARGEST_SYSTEMS),
    max_layers: int = max(LADDER),
    ladder: tuple[int, ...] = (),
    point_timeout: float = 900,
    nvme_dir: Path = NVME_DIR,
) -> cli.Answer:
    """The step-time part (2 ranks, every offload mode of each stage on the Linear stack, no offload first and again
    last) and the largest-model part (each system climbs the Llama ladder within the RAM budget).

    Args:
        part: both, step_time or largest.
        steps: step time: timed steps per mode (at least 10: medians).
        stages: step time: ZeRO stages.
        layers: step time: Linear layers.
        hidden: step time: Linear width.
        ram_budget_gb: largest model: RAM of the machine.
        systems: largest model: ddp, az3, az3_cpu, az3_nvme.
        max_layers: largest model: the top of the ladder.
        ladder: largest model: layer counts, ascending (default: LADDER up to max_layers).
        point_timeout: largest model: seconds before a ladder point is cut.
        nvme_dir: a folder on the local disk to measure (a fresh folder is made in it, deleted at the end).
    """
    if steps < 10:
        raise SystemExit(f"--steps={steps}: the step time is a median of at least 10 steps")
    args = argparse.Namespace(**locals())  # the parts read their options from it
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    nvme_dir.mkdir(parents=True, exist_ok=True)
    args.nvme_dir = Path(tempfile.mkdtemp(prefix="offload_bench_", dir=nvme_dir))  # concurrent runs do not collide
    try:
        if part in ("both", "step_time"):
            payload["step_time"] = step_time_part(args)
        if part in ("both", "largest"):
            payload["largest"] = largest_part(args)
    finally:
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            nvme_dir.rmdir()  # only when no other run uses it
    title = "offload_bench: step time per offload mode, the largest model in a RAM budget"
    return cli.Answer(title, markdown(payload), payload)


if __name__ == "__main__":
    sys.exit(cli.main(offload_bench, choices={"part": ("both", "step_time", "largest"), "systems": LARGEST_SYSTEMS}))
