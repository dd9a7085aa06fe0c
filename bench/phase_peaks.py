"""Stages 0-2 against DDP, ZeroRedundancyOptimizer and DeepSpeed: peak host memory per rank per training phase.

Usage:
    .venv/bin/python bench/phase_peaks.py --json bench/out/phase_peaks.json   # W = 4, 8 systems, one torchrun group each
    .venv/bin/python bench/phase_peaks.py --systems az2 ds2 --breakdown       # + engine.memory_breakdown()

The workload of bench/user_load.py, at stages 0-2: the same 66.9M-parameter Llama saved once with
`save_pretrained`, loaded on each of W gloo ranks by the user's own `AutoModelForCausalLM.from_pretrained`, handed
to the system, 2 steps of batch 1 x 64 tokens (labels = input_ids), fp32 AdamW lr 1e-4, one thread per rank,
`MALLOC_MMAP_THRESHOLD_=131072`. Each system runs in its own fresh torchrun group:
    ddp           DistributedDataParallel + torch.optim.AdamW
    zero1_torch   DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    az0/az1/az2   accelerate_zero.initialize(model, config) with zero_optimization.stage 0/1/2
    ds0/ds1/ds2   deepspeed.initialize with the same config, in DeepSpeed's own virtualenv (bench/ds_venv.py);
                  skipped with a note when that virtualenv cannot import deepspeed and transformers
Every library of the venv is imported before the baseline (the process group too); each rank records the modules
imported after it (`late_modules` in the JSON: none should be). Per phase (load, init, forward/backward/optimizer
of each step) a thread keeps the peak of RssAnon and RssFile (see user_load.PhasePeaks); the table is the
anonymous peak above the baseline, max over ranks, and "end" the anonymous memory after the last step.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

from ds_venv import DEFAULT_DS_VENV
from user_load import LLAMA, PhasePeaks, save_model


SYSTEMS = ["ddp", "zero1_torch", "az0", "az1", "az2", "ds0", "ds1", "ds2"]
PHASES = ["load", "init", "forward0", "backward0", "optimizer0", "forward1", "backward1", "optimizer1"]
# fp32 AdamW state per parameter held by a rank: weights 4, gradients 4, Adam moments 8 (divided by W if sharded).
STATE_BYTES = {"ddp": (16, 0), "zero1_torch": (8, 8), "0": (16, 0), "1": (8, 8), "2": (4, 12)}
MB = 1e6
# DeepSpeed modules its engine imports on first use (found with `late_modules`).
DS_MODULES = [
    "cpuinfo",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # (stages 1-2: torch._inductor, networkx: ~550 modules)
    "deepspeed.ops.adam",
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.module_inject.auto_ep_presets.registry",
    "deepspeed.moe.ep_experts",
    "deepspeed.moe.ep_repack",
    "deepspeed.moe.ep_router",
    "deepspeed.moe.fused_expert_layout",
    "deepspeed.ops.triton_ops.autoep_fused_token_ops",
    "deepspeed.ops.triton_ops.group_gemm_triton",
    "deepspeed.ops.triton_ops.swiglu_triton",
]


def zero_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
    }


def preload(system: str) -> None:
    """Imports what any system of this venv may import, so that no phase counts module memory."""
    import torch.distributed.optim  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.profiler._cupti_monitor  # noqa: F401  (imported by the first forward)
    import transformers.models.llama.modeling_llama  # noqa: F401

    if system.startswith("ds"):
        import deepspeed

        names = DS_MODULES
        packages: list = []
    else:
        import datasets  # noqa: F401

        import accelerate_zero

        names = []
        packages = [accelerate_zero]
    for package in packages:
        names += [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=print)]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # an optional integration whose library is absent
            print(f"preload: {name}: {type(error).__name__}", file=sys.stderr)
    if system.startswith("ds"):
        _ = deepspeed.initialize


def build(system: str, model):
    """Hands the model to the system; returns (forward, backward, step, engine or None)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if system in ("ddp", "zero1_torch"):
        wrapped = DistributedDataParallel(model)
        if system == "ddp":
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        return (lambda batch: wrapped(**batch).loss), (lambda loss: loss.backward()), step, None
    stage = int(system[-1])
    if system.startswith("az"):
        import accelerate_zero

        engine = accelerate_zero.initialize(model, config=zero_config(stage))
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=zero_config(stage))
    return (lambda batch: engine(**batch).loss), engine.backward, engine.step, engine


def worker(args: argparse.Namespace) -> None:
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a stuck rank prints its stacks and ends the run
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    preload(args.system)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.system.startswith("ds"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    modules = set(sys.modules)
    peaks = PhasePeaks()
    baseline = PhasePeaks.read()
    batch = {
        "input_ids": torch.randint(0, LLAMA["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(rank))
    }
    batch["labels"] = batch["input_ids"].clone()
    peaks.phase("load")
    model = AutoModelForCausalLM.from_pretrained(args.folder)
    peaks.phase("init")
    forward, backward, step, engine = build(args.system, model)
    breakdowns = {}

    def breakdown(name: str) -> None:
        if args.breakdown and args.system.startswith("az"):
            breakdowns[name] = {key: value for key, value in engine.memory_breakdown().items() if value}
            breakdowns[name]["RssAnon"] = PhasePeaks.read()["RssAnon"] - baseline["RssAnon"]

    breakdown("init")
    losses = []
    for index in range(2):  # (the user keeps `model`; `loss` lives until the next forward)
        peaks.phase(f"forward{index}")
        loss = forward(batch)
        breakdown(f"forward{index}")
        peaks.phase(f"backward{index}")
        backward(loss)
        breakdown(f"backward{index}")
        peaks.phase(f"optimizer{index}")
        step()
        breakdown(f"optimizer{index}")
        losses.append(loss.item())
    result = {"rank": rank, "baseline": baseline, **peaks.stop(), "losses": losses, "breakdowns": breakdowns}
    result["late_modules"] = sorted(set(sys.modules) - modules)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    forward = backward = step = engine = None  # DDP freed after its process group hung at exit once
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def ds_python(venv: Path) -> Path | None:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"DeepSpeed skipped: no virtualenv at {venv}")
        return None
    check = [str(python), "-c", "import deepspeed, transformers"]
    done = subprocess.run(check, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True)
    if done.returncode:
        print(f"DeepSpeed skipped: {python} cannot import deepspeed and transformers: {done.stderr.strip()[-300:]}")
        return None
    return python


def table(results: dict, params: int, world: int) -> None:
    systems = list(results["systems"])
    print(f"\nPeak anonymous memory above the baseline, MB per rank (max over {world} ranks)")
    print(f"{'phase':12s}" + "".join(f"{system:>12s}" for system in systems))
    for phase in [*PHASES, "end"]:
        cells = []
        for system in systems:
            ranks = results["systems"][system]
            kind = "ends" if phase == "end" else "peaks"
            key = "optimizer1" if phase == "end" else phase
            cells.append(max(r[kind][key]["RssAnon"] - r["baseline"]["RssAnon"] for r in ranks) / MB)
        print(f"{phase:12s}" + "".join(f"{cell:12.1f}" for cell in cells))
    states = []
    for system in systems:
        held, sharded = STATE_BYTES[system if system in STATE_BYTES else system[-1]]
        states.append((held + sharded / world) * params / MB)
    print(f"{'state':12s}" + "".join(f"{state:12.1f}" for state in states))
    for system in systems:
        ranks = results["systems"][system]
        late = sorted({name for r in ranks for name in r["late_modules"]})
        print(f"{system}: losses {ranks[0]['losses']}; modules imported after the baseline: {len(late)} {late[:8]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--folder", default="/tmp/az_user_load_llama")
    parser.add_argument("--ds_venv", type=Path, default=DEFAULT_DS_VENV)
    parser.add_argument("--json", default="bench/out/phase_peaks.json")
    parser.add_argument("--breakdown", action="store_true", help="record engine.memory_breakdown() (ours) per phase")
    parser.add_argument("--hang_s", type=float, default=300, help="a rank stuck this long dumps its stacks, exits")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="az2", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = save_model(folder)
    print(f"model: {sizes['params'] / 1e6:.1f}M parameters, W = {args.world_size}")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    python = None
    if any(system.startswith("ds") for system in args.systems):
        python = ds_python(args.ds_venv)
    results: dict = {"sizes": sizes, "world_size": args.world_size, "systems": {}, "skipped": []}
    for system in args.systems:
        interpreter = python if system.startswith("ds") else Path(sys.executable)
        if interpreter is None:
            results["skipped"].append(system)
            continue
        out = folder / f"phase_peaks_{system}.json"
        out.unlink(missing_ok=True)
        command = [str(interpreter), "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={args.world_size}", __file__, "--worker", "--system", system]
        command += ["--folder", str(folder), "--out", str(out), "--hang_s", str(args.hang_s)]
        command += ["--breakdown"] * args.breakdown
        print(f"\n== {system}", flush=True)
        subprocess.run(command, env=env, check=True)
        results["systems"][system] = json.loads(out.read_text())
    table(results, sizes["params"], args.world_size)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"raw readings: {args.json}")


if __name__ == "__main__":
    main()
