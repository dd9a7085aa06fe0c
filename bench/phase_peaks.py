"""Stages 0-2 against DDP, ZeroRedundancyOptimizer and DeepSpeed: peak host memory per rank per training phase, on
user_load.py's workload (bench/README.md, "Stages 0-2 against DDP, ZeroRedundancyOptimizer and DeepSpeed").

Usage:
    .venv/bin/python bench/phase_peaks.py --json bench/out/phase_peaks.json   # W = 4, 8 systems, a group each
    .venv/bin/python bench/phase_peaks.py --systems az2 ds2 --breakdown       # + engine.memory_breakdown()

Systems: `ddp` (DistributedDataParallel + AdamW), `zero1_torch` (DDP + ZeroRedundancyOptimizer(AdamW)), `az0`-`az2`
(`accelerate_zero.initialize` at that stage), `ds0`-`ds2` (`deepspeed.initialize`, from DeepSpeed's own
virtualenv). Every library is imported before the baseline; each rank records the modules imported after it
(`late_modules`: none should be). The table is the anonymous peak per phase above the baseline, max over ranks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path
from typing import Any

from harness import launch, report
from harness.summary import MB
from user_load import SHAPES, save_model


SYSTEMS = ["ddp", "zero1_torch", "az0", "az1", "az2", "ds0", "ds1", "ds2"]
PHASES = ["load", "init", "forward0", "backward0", "optimizer0", "forward1", "backward1", "optimizer1"]
STATE_BYTES = {"ddp": (16, 0), "zero1_torch": (8, 8), "0": (16, 0), "1": (8, 8), "2": (4, 12)}
"""fp32 AdamW state per parameter held by a rank: (replicated, divided by W)."""
DS_MODULES = [
    "cpuinfo", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # (stages 1-2: torch._inductor, networkx: ~550 modules)
    "deepspeed.ops.adam", "deepspeed.module_inject.auto_ep_layer", "deepspeed.module_inject.auto_ep_presets.registry",
    "deepspeed.moe.ep_experts", "deepspeed.moe.ep_repack", "deepspeed.moe.ep_router",
    "deepspeed.moe.fused_expert_layout",
    "deepspeed.ops.triton_ops.autoep_fused_token_ops", "deepspeed.ops.triton_ops.group_gemm_triton",
    "deepspeed.ops.triton_ops.swiglu_triton",
]  # fmt: skip
"""DeepSpeed modules its engine imports on first use (found with `late_modules`)."""


def zero_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}  # fmt: skip


def preload(system: str) -> None:
    """Imports what any system of this venv may import, so that no phase counts module memory."""
    import importlib
    import pkgutil
    import sys

    import torch.distributed.optim  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.profiler._cupti_monitor  # noqa: F401  (imported by the first forward)
    import transformers.models.llama.modeling_llama  # noqa: F401

    if system.startswith("ds"):
        import deepspeed

        names = list(DS_MODULES)
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import datasets  # noqa: F401

        import accelerate_zero

        names = [
            info.name for info in pkgutil.walk_packages(accelerate_zero.__path__, "accelerate_zero.", onerror=print)
        ]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # an optional integration whose library is absent
            print(f"preload: {name}: {type(error).__name__}", file=sys.stderr)


def build(system: str, model: Any) -> tuple[Any, Any, Any, Any]:
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
    if system.startswith("az"):
        import accelerate_zero

        engine = accelerate_zero.initialize(model, config=zero_config(int(system[-1])))
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=zero_config(int(system[-1]))
        )
    return (lambda batch: engine(**batch).loss), engine.backward, engine.step, engine


def phases(system: str, folder: str, breakdown: bool, hang_s: float) -> dict[str, Any]:
    """Rank function: the baseline after every import, then load, hand over and train 2 steps, each phase sampled."""
    import faulthandler
    import gc
    import sys

    import torch.distributed as dist
    from harness import models
    from harness.readings import PeakSampler
    from transformers import AutoModelForCausalLM

    faulthandler.dump_traceback_later(hang_s, exit=True)  # a stuck rank prints its stacks and ends the run
    preload(system)
    modules, rank = set(sys.modules), dist.get_rank()
    peaks = PeakSampler(("RssAnon", "RssFile"), phase="baseline").start()
    baseline = peaks.read()
    batch = {"input_ids": models.tokens(1, 64, SHAPES["llama67m"]["vocab"], seed=rank)}
    batch["labels"] = batch["input_ids"].clone()
    peaks.phase("load")
    model = AutoModelForCausalLM.from_pretrained(folder)
    peaks.phase("init")
    forward, backward, step, engine = build(system, model)
    breakdowns: dict[str, dict[str, int]] = {}

    def read_breakdown(name: str) -> None:
        if breakdown and system.startswith("az"):
            breakdowns[name] = {key: value for key, value in engine.memory_breakdown().items() if value}
            breakdowns[name]["RssAnon"] = peaks.read()["RssAnon"] - baseline["RssAnon"]

    read_breakdown("init")
    losses = []
    for index in range(2):  # (the user keeps `model`; `loss` lives until the next forward)
        peaks.phase(f"forward{index}")
        loss = forward(batch)
        read_breakdown(f"forward{index}")
        peaks.phase(f"backward{index}")
        backward(loss)
        read_breakdown(f"backward{index}")
        peaks.phase(f"optimizer{index}")
        step()
        read_breakdown(f"optimizer{index}")
        losses.append(loss.item())
    result = {"rank": rank, "baseline": baseline, **peaks.stop(), "losses": losses, "breakdowns": breakdowns}
    result["late_modules"] = sorted(set(sys.modules) - modules)
    forward = backward = step = engine = None  # DDP freed before the process group ends (it hung at exit once)
    gc.collect()
    faulthandler.cancel_dump_traceback_later()
    return result


def ds_python(venv: Path) -> Path | None:
    """DeepSpeed's interpreter, or None (with the reason printed) when it cannot import deepspeed and transformers."""
    python = launch.deepspeed_python(venv)
    if python is None:
        print(f"DeepSpeed skipped: no virtualenv at {venv}")
        return None
    check = [str(python), "-c", "import deepspeed, transformers"]
    done = subprocess.run(check, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True)
    if done.returncode:
        print(f"DeepSpeed skipped: {python} cannot import deepspeed and transformers: {done.stderr.strip()[-300:]}")
        return None
    return python


def table(results: dict[str, Any], params: int, world: int) -> str:
    systems = results["systems"]

    def anonymous(ranks: list[dict[str, Any]], phase: str) -> str:  # "end": after the last step
        kind, key = ("ends", "optimizer1") if phase == "end" else ("peaks", phase)
        return report.fmt(max(r[kind][key]["RssAnon"] - r["baseline"]["RssAnon"] for r in ranks) / MB)

    rows = [(phase, *(anonymous(ranks, phase) for ranks in systems.values())) for phase in [*PHASES, "end"]]
    states = [STATE_BYTES[s if s in STATE_BYTES else s[-1]] for s in systems]
    rows.append(("state", *(report.fmt((held + sharded / world) * params / MB) for held, sharded in states)))
    lines = [f"Peak anonymous memory above the baseline, MB per rank (max over {world} ranks)\n",
             report.table(["phase", *systems], rows)]  # fmt: skip
    for system, ranks in systems.items():
        late = sorted({name for r in ranks for name in r["late_modules"]})
        lines.append(
            f"{system}: losses {ranks[0]['losses']}; modules imported after the baseline: {len(late)} {late[:8]}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--folder", default="/tmp/az_user_load_llama")
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV)
    parser.add_argument("--json", type=Path, default=Path("bench/out/phase_peaks.json"))
    parser.add_argument("--breakdown", action="store_true", help="record engine.memory_breakdown() (ours) per phase")
    parser.add_argument("--hang_s", type=float, default=300, help="a rank stuck this long dumps its stacks, exits")
    args = parser.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    sizes, facts = save_model(folder), report.machine_facts()
    python = ds_python(args.ds_venv) if any(system.startswith("ds") for system in args.systems) else None
    results: dict[str, Any] = {"sizes": sizes, "world_size": args.world_size, "systems": {}, "skipped": []}
    for system in args.systems:
        if system.startswith("ds") and python is None:
            results["skipped"].append(system)
            continue
        kwargs = {"system": system, "folder": str(folder), "breakdown": args.breakdown, "hang_s": args.hang_s}
        ranks = launch.on_ranks(
            args.world_size, phases, kwargs, name=system, python=python if system.startswith("ds") else None
        )
        results["systems"][system] = ranks.results
    print(report.header(facts, f"phase_peaks: {sizes['params'] / 1e6:.1f}M parameters, W = {args.world_size}"))
    print(table(results, sizes["params"], args.world_size))
    if args.json:
        report.save_json(args.json, results, facts)


if __name__ == "__main__":
    main()
