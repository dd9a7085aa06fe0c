"""The way DeepSpeed users load: their own `from_pretrained`, then the engine; peak host memory per rank per phase,
against FSDP2 and DeepSpeed (bench/README.md, "user_load.py", says what each entry point and cell is).

Usage:
    .venv/bin/python bench/user_load.py                                   # W = 4, every entry point (~2 min)
    .venv/bin/python bench/user_load.py --entries initialize --world_size 2
    .venv/bin/python bench/user_load.py --json bench/out/user_load.json
    .venv/bin/python bench/user_load.py --shape llama69m --entries initialize fsdp2 fsdp2_accelerate   # issue 44
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import launch, report
from harness.summary import MB


SHAPES = {
    "llama67m": dict(hidden=512, intermediate=1536, layers=10, heads=8, vocab=32000),
    # issue 44, item 12: a decoder layer (7.1M parameters) larger than either embedding (6.3M): 69.2M parameters
    "llama69m": dict(hidden=768, intermediate=2048, layers=8, heads=12, vocab=8192),
}
FOLDERS = {"llama67m": "/tmp/az_user_load_llama", "llama69m": "/tmp/az_user_load_llama69m"}
ENTRIES = ["initialize", "accelerator", "trainer", "fsdp2", "fsdp2_accelerate", "ds3"]
ZERO3: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3},
}


def llama_config(shape: str) -> Any:
    from harness import models

    size = dict(SHAPES[shape])
    return models.llama_config(size.pop("hidden"), size.pop("layers"), **size)


def save_model(folder: Path, shape: str = "llama67m") -> dict[str, int]:
    """Saves the shape's Llama (seed 0) once with `save_pretrained`; its sizes (kept beside it)."""
    from harness import models

    sizes_file = folder / "bench_sizes.json"
    if sizes_file.exists():
        return json.loads(sizes_file.read_text())
    model = models.llama(llama_config(shape))
    model.save_pretrained(folder)
    sizes = {
        "params": sum(p.numel() for p in model.parameters()),
        "layer_bytes": sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()),
        "largest_tensor_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
    }
    sizes_file.write_text(json.dumps(sizes))
    return sizes


def count_gradient_arenas_whole() -> None:
    """Makes each gradient arena resident when it is allocated, as a device's caching allocator counts it.

    [Note: resident pages against allocated bytes] The arena is `torch.empty` (engine/kept_grads.py): on the CPU its
    pages count in RSS only once written, and the stage-3 backward writes the shard one reduce-scatter at a time,
    so RSS at the start of backward holds a small part of it. A device allocator counts the whole arena from its
    allocation, and so does the estimate (accelerate_zero/debug/phases.py). This run-time wrapper of our own class
    (this benchmark's process only) fills it once at allocation so that RSS measures what a device would hold."""
    from accelerate_zero.engine.kept_grads import GradArena

    take = GradArena.take

    def take_resident(self: GradArena, offset: int, numel: int) -> Any:
        fresh = self._flat is None
        slot = take(self, offset, numel)
        if fresh:
            self._flat.zero_()
        return slot

    GradArena.take = take_resident


def shard_like_fsdp2(model: Any, reshard: bool, accelerate_policy: bool) -> None:
    """FSDP2 units: `fully_shard` on each decoder layer, then the root (`fsdp2`), or accelerate 1.15's own policy
    (`fsdp2_accelerate`, `fsdp2_prepare_model` in its `utils/fsdp_utils.py` for an untied model): the decoder
    layers, the input embedding with the same `reshard_after_forward`, the final norm and the LM head in one tail
    unit never resharded after forward, and the root with torch's default (not resharded either)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    if not accelerate_policy:
        fully_shard(model, reshard_after_forward=reshard)
        return
    fully_shard(model.get_input_embeddings(), reshard_after_forward=reshard)
    fully_shard([model.model.norm, model.get_output_embeddings()], reshard_after_forward=False)
    fully_shard(model)


Steps = tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]]
"""forward() -> loss, backward(loss), optimizer step: what each entry point's user calls."""


def load_and_train(entry: str, folder: str, shape: str, zero: dict[str, Any], arena_whole: bool) -> dict[str, Any]:
    """Rank function: the baseline after the imports, then load, hand over and train 2 steps, each phase sampled."""
    import torch
    import torch.distributed as dist
    from harness import models
    from harness.readings import PeakSampler
    from transformers import AutoModelForCausalLM

    config = dict(ZERO3, zero_optimization={**ZERO3["zero_optimization"], **zero})
    before_load = _deepspeed_before_load(config) if entry == "ds3" else _ours_before_load(entry, config, arena_whole)
    peaks = PeakSampler(("RssAnon", "RssFile"), phase="baseline").start()
    baseline = peaks.read()
    rank = dist.get_rank()
    batch = {"input_ids": models.tokens(1, 64, SHAPES[shape]["vocab"], seed=rank)}
    batch["labels"] = batch["input_ids"].clone()
    prepared = before_load(folder, rank)  # TrainingArguments and ZeroAccelerator exist before the model, as users do
    peaks.phase("load")
    model = AutoModelForCausalLM.from_pretrained(folder)
    peaks.phase("init")
    if entry == "trainer":
        from datasets import Dataset

        import accelerate_zero

        rows = [{"input_ids": batch["input_ids"][0].tolist(), "labels": batch["labels"][0].tolist()}] * 4
        trainer = accelerate_zero.Trainer(model=model, args=prepared, train_dataset=Dataset.from_list(rows))
        peaks.phase("train")  # the Trainer builds the engine inside train()
        trainer.train()
    else:
        forward, backward, step = _hand_over(entry, model, batch, config, prepared, torch)
        for index in range(2):  # (the user keeps `model`: the engine holds the same module)
            peaks.phase(f"forward{index}")
            loss = forward()
            peaks.phase(f"backward{index}")
            backward(loss)
            peaks.phase(f"optimizer{index}")
            step()
    return {"rank": rank, "baseline": baseline, **peaks.stop()}


def _ours_before_load(entry: str, config: dict[str, Any], arena_whole: bool) -> Callable[[str, int], Any]:
    import datasets  # noqa: F401  (imported before the baseline: no phase counts the Trainer's modules, ~100 MB)

    import accelerate_zero
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    if arena_whole:
        count_gradient_arenas_whole()
    _ = accelerate_zero.ZeroAccelerator, accelerate_zero.Trainer  # their lazy imports, before the baseline too

    def before_load(folder: str, rank: int) -> Any:
        if entry == "trainer":
            return accelerate_zero.TrainingArguments(
                output_dir=str(Path(folder) / f"out_{rank}"), zero_config=config, per_device_train_batch_size=1,
                max_steps=2, learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
            )  # fmt: skip
        if entry == "accelerator":
            plugin = {key: value for key, value in config.items() if key != "optimizer"}  # the loop's optimizer
            plugin["gradient_accumulation_steps"] = "auto"
            return accelerate_zero.ZeroAccelerator(ZeroPlugin(config=plugin), cpu=True)
        return None

    return before_load


def _deepspeed_before_load(config: dict[str, Any]) -> Callable[[str, int], Any]:
    """DeepSpeed's own way, in its virtualenv: `HfDeepSpeedConfig` alive before `from_pretrained`, so transformers
    builds and loads the model under `zero.Init` (each rank keeps its partition)."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
    zero = config["zero_optimization"]
    for key in ("stage3_max_reuse_distance", "stage3_max_live_parameters"):  # DeepSpeed takes integers
        if key in zero:
            zero[key] = int(zero[key])
    return lambda folder, rank: HfDeepSpeedConfig(config)  # kept alive: transformers reads it by a weak reference


def _hand_over(entry: str, model: Any, batch: dict, config: dict, prepared: Any, torch: Any) -> Steps:
    """The model handed to the entry point: its forward, backward and optimizer step."""
    if entry == "ds3":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return (lambda: engine(**batch).loss), engine.backward, engine.step
    if entry == "initialize":
        import accelerate_zero

        engine = accelerate_zero.initialize(model, config=config)
        return (lambda: engine(**batch).loss), engine.backward, engine.step
    if entry.startswith("fsdp2"):
        reshard = config["zero_optimization"].get("stage3_max_reuse_distance", 1e9) == 0
        shard_like_fsdp2(model, reshard, accelerate_policy=entry == "fsdp2_accelerate")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if entry == "accelerator":
        model, optimizer = prepared.prepare(model, optimizer)
    backward = prepared.backward if entry == "accelerator" else (lambda loss: loss.backward())

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return (lambda: model(**batch).loss), backward, step


def phase_rows(ranks: list[dict[str, Any]], state: float) -> list[tuple]:
    """Per phase: the anonymous and file-backed peaks above the baseline, max over ranks, and the anonymous end."""
    rows = []
    for phase in ranks[0]["peaks"]:
        if phase == "baseline":
            continue
        anon, file, end = (
            max(r[kind][phase][key] - r["baseline"][key] for r in ranks)
            for kind, key in (("peaks", "RssAnon"), ("peaks", "RssFile"), ("ends", "RssAnon"))
        )
        rows.append((phase, report.fmt(anon / MB), report.fmt(file / MB), f"{anon / state:.2f}", report.fmt(end / MB)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--entries", nargs="+", default=ENTRIES, choices=ENTRIES)
    parser.add_argument("--shape", default="llama67m", choices=sorted(SHAPES), help="the Llama (default: issue 31's)")
    parser.add_argument("--folder", default=None, help="where the model is saved (default: one folder per shape)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--zero", default="{}", help="JSON merged into zero_optimization (e.g. reuse distance)")
    parser.add_argument(
        "--arena_whole", action="store_true",
        help="count each gradient arena whole from its allocation, as a device allocator does (see the note)",
    )  # fmt: skip
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV)
    args = parser.parse_args()
    folder = Path(args.folder or FOLDERS[args.shape])
    folder.mkdir(parents=True, exist_ok=True)
    sizes, facts = save_model(folder, args.shape), report.machine_facts()
    state = 16 * sizes["params"] / args.world_size
    print(report.header(facts, f"user_load: {args.shape}, W = {args.world_size}, stage 3"))
    print(
        f"model: {sizes['params'] / 1e6:.1f}M parameters; state per rank (16 B/param / {args.world_size}): "
        f"{state / MB:.0f} MB; one layer {sizes['layer_bytes'] / MB:.1f} MB, largest tensor "
        f"{sizes['largest_tensor_bytes'] / MB:.1f} MB"
    )
    results: dict[str, Any] = {"sizes": sizes, "world_size": args.world_size, "entries": {}}
    for entry in args.entries:
        python = launch.deepspeed_python(args.ds_venv) if entry == "ds3" else None
        if entry == "ds3" and python is None:
            print(f"\nds3: skipped, no DeepSpeed virtualenv at {args.ds_venv} (harness/launch.py says how to make it)")
            continue
        kwargs = dict(entry=entry, folder=str(folder), shape=args.shape, zero=json.loads(args.zero))
        ranks = launch.on_ranks(args.world_size, load_and_train, dict(kwargs, arena_whole=args.arena_whole),
                                name=entry, python=python).results  # fmt: skip
        results["entries"][entry] = ranks
        print(f"\n{entry}: peak above the baseline per rank, MB, max over ranks\n")
        columns = ["phase", "peak anonymous", "peak file-backed", "anonymous / state", "anonymous at its end"]
        print(report.table(columns, phase_rows(ranks, state)))
    if args.json:
        report.save_json(args.json, results, facts)


if __name__ == "__main__":
    main()
