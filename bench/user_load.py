"""The way DeepSpeed users load, their own `from_pretrained` then the system: the peak host memory of every phase
per rank, ours at stages 0-3 and through ZeroAccelerator and the Trainer against DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed (bench/README.md, "user_load.py").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import cli, launch, models, report
from harness.summary import MB


SHAPES = {
    "llama67m": dict(hidden=512, intermediate=1536, layers=10, heads=8, vocab=32000),
    # issue 44, item 12: a decoder layer (7.1M parameters) larger than either embedding (6.3M): 69.2M parameters
    "llama69m": dict(hidden=768, intermediate=2048, layers=8, heads=12, vocab=8192),
}
SYSTEMS = ["az3", "accelerator", "trainer", "fsdp2", "fsdp2_accelerate", "ds3"]
"""Stage 3's entry points (azS, dsS: accelerate_zero.initialize / deepspeed.initialize at stage S)."""
CHOICES = [*SYSTEMS, "ddp", "zero1_torch", "az0", "az1", "az2", "ds0", "ds1", "ds2"]
STATE_BYTES = {"ddp": (16, 0), "zero1_torch": (8, 8), "0": (16, 0), "1": (8, 8), "2": (4, 12), "3": (0, 16)}
"""fp32 AdamW state per parameter held by a rank: (replicated, divided by W); ours and DeepSpeed's by stage."""
DS_MODULES = [
    "cpuinfo", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # (stages 1-2: torch._inductor, networkx: ~550 modules)
    "deepspeed.ops.adam", "deepspeed.module_inject.auto_ep_layer", "deepspeed.module_inject.auto_ep_presets.registry",
    "deepspeed.moe.ep_experts", "deepspeed.moe.ep_repack", "deepspeed.moe.ep_router",
    "deepspeed.moe.fused_expert_layout", "deepspeed.ops.triton_ops.autoep_fused_token_ops",
    "deepspeed.ops.triton_ops.group_gemm_triton", "deepspeed.ops.triton_ops.swiglu_triton",
    "transformers.integrations.deepspeed",
]  # fmt: skip
"""DeepSpeed modules its engine imports on first use (found with `late_modules`)."""


def save_model(folder: Path, shape: str) -> dict[str, int]:
    """Saves the shape's Llama (seed 0) once with `save_pretrained`; its sizes (kept beside it)."""
    sizes_file = folder / "bench_sizes.json"
    if not sizes_file.exists():
        size = dict(SHAPES[shape])
        model = models.llama(models.llama_config(size.pop("hidden"), size.pop("layers"), **size))
        model.save_pretrained(folder)
        sizes = {"params": sum(p.numel() for p in model.parameters()),
                 "layer_bytes": sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()),
                 "largest_tensor_bytes": max(p.numel() * p.element_size() for p in model.parameters())}  # fmt: skip
        sizes_file.write_text(json.dumps(sizes))
    return json.loads(sizes_file.read_text())


def preload(system: str) -> None:
    """Imports what any system of this virtualenv may import, so that no phase counts module memory."""
    import importlib
    import pkgutil

    import torch.distributed.optim  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.profiler._cupti_monitor  # noqa: F401  (imported by the first forward)
    import transformers.models.llama.modeling_llama  # noqa: F401

    if system.startswith("ds"):
        import deepspeed

        names = list(DS_MODULES)
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import datasets  # noqa: F401  (the Trainer's, ~100 MB)

        import accelerate_zero

        names = [i.name for i in pkgutil.walk_packages(accelerate_zero.__path__, "accelerate_zero.", onerror=print)]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # an optional integration whose library is absent
            print(f"preload: {name}: {type(error).__name__}", file=sys.stderr)


def shard_like_fsdp2(model: Any, reshard: bool, accelerate_policy: bool) -> None:
    """FSDP2 units: `fully_shard` on each decoder layer, then the root (`fsdp2`), or accelerate 1.15's own policy
    for an untied model (`fsdp2_accelerate`, `fsdp2_prepare_model`): the decoder layers, the input embedding with the
    same `reshard_after_forward`, the final norm and the LM head in one tail unit never resharded after forward,
    the root with torch's default (not resharded either)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    if accelerate_policy:
        fully_shard(model.get_input_embeddings(), reshard_after_forward=reshard)
        fully_shard([model.model.norm, model.get_output_embeddings()], reshard_after_forward=False)
    fully_shard(model, **({} if accelerate_policy else {"reshard_after_forward": reshard}))


def _before_load(system: str, config: dict[str, Any], folder: str, rank: int) -> Any:
    """What a user makes before `from_pretrained`: TrainingArguments, the ZeroAccelerator, or DeepSpeed's
    `HfDeepSpeedConfig` (transformers then builds and loads under `zero.Init`: each rank keeps its partition)."""
    import accelerate_zero

    if system == "trainer":
        return accelerate_zero.TrainingArguments(
            output_dir=str(Path(folder) / f"out_{rank}"), zero_config=config, per_device_train_batch_size=1,
            max_steps=2, learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        )  # fmt: skip
    if system == "accelerator":
        from accelerate_zero.integrations.accelerate import ZeroPlugin

        plugin = {key: value for key, value in config.items() if key != "optimizer"}  # the loop's optimizer
        return accelerate_zero.ZeroAccelerator(ZeroPlugin(config=dict(plugin, gradient_accumulation_steps="auto")),
                                               cpu=True)  # fmt: skip
    return None


def _deepspeed_config(config: dict[str, Any]) -> Any:
    """DeepSpeed at stages 0-2 builds its FusedAdam CPU op from "AdamW"; at stage 3 torch's AdamW, and the
    `HfDeepSpeedConfig` alive before `from_pretrained` (kept: transformers reads it by a weak reference)."""
    zero = config["zero_optimization"]
    for key in ("stage3_max_reuse_distance", "stage3_max_live_parameters"):  # DeepSpeed takes integers
        if key in zero:
            zero[key] = int(zero[key])
    if zero["stage"] < 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    config["optimizer"]["params"]["torch_adam"] = True
    return HfDeepSpeedConfig(config)


def _hand_over(system: str, model: Any, batch: dict, config: dict, prepared: Any) -> tuple[Callable, ...]:
    """The model handed to the system: (forward, backward, optimizer step, engine or None)."""
    import torch

    if system[:2] in ("az", "ds"):
        if system.startswith("ds"):
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        else:
            import accelerate_zero

            engine = accelerate_zero.initialize(model, config=config)
        return (lambda: engine(**batch).loss), engine.backward, engine.step, engine
    if system.startswith("fsdp2"):
        reshard = config["zero_optimization"].get("stage3_max_reuse_distance", 1e9) == 0
        shard_like_fsdp2(model, reshard, accelerate_policy=system == "fsdp2_accelerate")
    if system in ("ddp", "zero1_torch"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    if system == "zero1_torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if system == "accelerator":
        model, optimizer = prepared.prepare(model, optimizer)
    backward = prepared.backward if system == "accelerator" else (lambda loss: loss.backward())

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return (lambda: model(**batch).loss), backward, step, None


def load_and_train(system: str, folder: str, shape: str, zero: dict, arena_whole: bool, breakdown: bool,
                   hang_s: float) -> dict[str, Any]:  # fmt: skip
    """Rank function: the baseline after every import, then load, hand over and train 2 steps, each phase sampled
    (`PeakSampler`); the modules imported after the baseline (none should be)."""
    import faulthandler
    import gc

    import torch.distributed as dist
    from harness.readings import PeakSampler, count_gradient_arenas_whole
    from transformers import AutoModelForCausalLM

    faulthandler.dump_traceback_later(hang_s, exit=True)  # a stuck rank prints its stacks and ends the run
    stage = int(system[-1]) if system[-1].isdigit() else 3
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization":
              {"stage": stage, **zero}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}  # fmt: skip
    preload(system)
    if arena_whole:
        count_gradient_arenas_whole()
    rank = dist.get_rank()
    batch = {"input_ids": models.tokens(1, 64, SHAPES[shape]["vocab"], seed=rank)}
    batch["labels"] = batch["input_ids"].clone()
    # Made before the model, as users do (DeepSpeed's HfDeepSpeedConfig must be alive during from_pretrained).
    prepared = _deepspeed_config(config) if system.startswith("ds") else _before_load(system, config, folder, rank)
    modules, peaks = set(sys.modules), PeakSampler(("RssAnon", "RssFile"), phase="baseline").start()
    baseline, held = peaks.read(), {}
    peaks.phase("load")
    model = AutoModelForCausalLM.from_pretrained(folder)
    peaks.phase("init")
    losses = []
    if system == "trainer":
        from datasets import Dataset

        import accelerate_zero

        rows = [{"input_ids": batch["input_ids"][0].tolist(), "labels": batch["labels"][0].tolist()}] * 4
        trainer = accelerate_zero.Trainer(model=model, args=prepared, train_dataset=Dataset.from_list(rows))
        peaks.phase("train")  # the Trainer builds the engine inside train()
        trainer.train()
    else:
        forward, backward, step, engine = _hand_over(system, model, batch, config, prepared)

        def read(phase: str) -> None:
            if breakdown and system.startswith("az"):
                held[phase] = {key: value for key, value in engine.memory_breakdown().items() if value}

        for index in range(2):  # (the user keeps `model`: the engine holds the same module)
            peaks.phase(f"forward{index}")
            loss = forward()
            read(f"forward{index}")
            peaks.phase(f"backward{index}")
            backward(loss)
            read(f"backward{index}")
            peaks.phase(f"optimizer{index}")
            step()
            read(f"optimizer{index}")
            losses.append(loss.item())
        forward = backward = step = engine = None  # DDP freed before the process group ends (it hung at exit once)
    result = {"rank": rank, "baseline": baseline, **peaks.stop(), "losses": losses, "breakdowns": held,
              "late_modules": sorted(set(sys.modules) - modules)}  # fmt: skip
    gc.collect()
    faulthandler.cancel_dump_traceback_later()
    return result


def user_load(
    systems: tuple[str, ...] = tuple(SYSTEMS),
    world_size: int = 4,
    shape: str = "llama67m",
    folder: str | None = None,
    zero: str = "{}",
    arena_whole: bool = False,
    breakdown: bool = False,
    hang_s: float = 300,
    ds_venv: Path = launch.DEFAULT_DS_VENV,
) -> cli.Answer:
    """The peak above the baseline of every phase, per system: anonymous and file-backed, MB per rank, max over ranks.

    Args:
        systems: azS / dsS (initialize at stage S), accelerator, trainer (stage 3), ddp, zero1_torch, fsdp2,
            fsdp2_accelerate.
        world_size: processes per system.
        shape: the Llama (llama67m: issue 31's; llama69m: decoder layers larger than the embeddings).
        folder: where the model is saved (default: /tmp/az_user_load_<shape>).
        zero: JSON merged into zero_optimization (e.g. the reuse distance; FSDP2 reshards after forward at 0).
        arena_whole: count each gradient arena whole from its allocation, as a device allocator does.
        breakdown: record engine.memory_breakdown() (ours) at the end of each phase.
        hang_s: a rank stuck this long dumps its stacks and exits.
        ds_venv: DeepSpeed's own virtualenv.
    """
    where = Path(folder or f"/tmp/az_user_load_{shape}")
    where.mkdir(parents=True, exist_ok=True)
    sizes, results = save_model(where, shape), {}
    python = launch.deepspeed_python(ds_venv)
    for system in systems:
        if system.startswith("ds") and python is None:
            print(f"{system}: skipped, no DeepSpeed virtualenv at {ds_venv} (harness/launch.py says how to make it)")
            continue
        kwargs = dict(system=system, folder=str(where), shape=shape, zero=json.loads(zero), arena_whole=arena_whole,
                      breakdown=breakdown, hang_s=hang_s)  # fmt: skip
        results[system] = launch.on_ranks(world_size, load_and_train, kwargs, name=system,
                                          python=python if system.startswith("ds") else None).results  # fmt: skip
    phases = list(dict.fromkeys(p for ranks in results.values() for p in ranks[0]["peaks"] if p != "baseline"))

    def cell(ranks: list[dict[str, Any]], phase: str, key: str) -> str:
        kind, phase = ("ends", list(ranks[0]["ends"])[-1]) if phase == "between steps" else ("peaks", phase)
        if phase not in ranks[0][kind]:  # the Trainer's one phase, "train"
            return ""
        return report.fmt(max(r[kind][phase][key] - r["baseline"][key] for r in ranks) / MB)

    text = [
        f"{sizes['params'] / 1e6:.1f}M parameters; one layer {sizes['layer_bytes'] / MB:.1f} MB, largest "
        f"tensor {sizes['largest_tensor_bytes'] / MB:.1f} MB; MB per rank above the baseline, max over ranks"
    ]
    for key in ("RssAnon", "RssFile"):
        rows = [(p, *(cell(ranks, p, key) for ranks in results.values())) for p in [*phases, "between steps"]]
        if key == "RssAnon":
            states = [STATE_BYTES.get(s, STATE_BYTES[s[-1] if s[-1].isdigit() else "3"]) for s in results]
            rows.append(("state", *(report.fmt((a + b / world_size) * sizes["params"] / MB) for a, b in states)))
        text += [
            f"Peak {'anonymous' if key == 'RssAnon' else 'file-backed'} memory",
            report.table(["phase", *results], rows),
        ]
    for system, ranks in results.items():
        late = sorted({name for r in ranks for name in r["late_modules"]})
        text.append(
            f"{system}: losses {ranks[0]['losses']}; modules imported after the baseline: {len(late)} {late[:8]}"
        )
    title = f"user_load: {shape}, W = {world_size}, zero_optimization {zero}"
    return cli.Answer(title, "\n\n".join(text), {"sizes": sizes, "systems": results})


if __name__ == "__main__":
    sys.exit(cli.main(user_load, choices={"systems": CHOICES, "shape": sorted(SHAPES)}))
