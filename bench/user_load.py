"""The way DeepSpeed users load: their own `from_pretrained`, then the engine. Peak host memory per rank per phase.

Usage:
    .venv/bin/python bench/user_load.py                                   # W = 4, every entry point (~2 min)
    .venv/bin/python bench/user_load.py --entries initialize --world_size 2
    .venv/bin/python bench/user_load.py --json bench/out/user_load.json
    .venv/bin/python bench/user_load.py --shape llama69m --entries initialize fsdp2 fsdp2_accelerate   # issue 44

A LlamaForCausalLM of 66.9M parameters (268 MB in fp32, untied; `--shape llama69m`: issue 44's 69.2M, whose decoder
layers are larger than its embeddings) is saved once with `save_pretrained` into
`--folder`, then on W gloo ranks (one thread each, `MALLOC_MMAP_THRESHOLD_=131072` so that freed tensors go back
to the OS) each rank: reads its baseline after the imports (the Trainer's and accelerate's too) and the process
group; builds `TrainingArguments` /
`ZeroAccelerator` with the stage-3 config first when the entry point is the Trainer or the accelerator (as users
do, and as DeepSpeed needs for `zero.Init`); calls `AutoModelForCausalLM.from_pretrained(folder)` itself; hands
the model to the entry point (`initialize`, `ZeroAccelerator.prepare`, `Trainer`, or the peer FSDP2: `fully_shard`
on each decoder layer and the root, or accelerate 1.15's own policy, `fsdp2_accelerate`: see `shard_like_fsdp2`);
trains 2 steps (phases forward/backward/optimizer of each; the Trainer's engine is built inside `train()`, one
phase). A thread
polls /proc/self/status every 2 ms and keeps, per phase (load, init, step), the peak of RssAnon (the process's
own memory) and of RssFile (pages of mapped files: the safetensors file transformers maps lazily; shared with
the other ranks and the page cache, dropped by the kernel under pressure, so reported apart). The goal (issue
31, item 1): the anonymous peak per rank at most the rank's training state (16 bytes per parameter / W for fp32
AdamW at stage 3) plus one unit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path


LLAMA = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
)
# Issue 44, item 12: wide layers and a small vocabulary, so that a decoder layer (7.1M parameters, 28.3 MB) is larger
# than either embedding (6.3M, 25.2 MB): 69.2M parameters.
LLAMA_69M = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=8192,
    tie_word_embeddings=False,
)
SHAPES = {"llama67m": LLAMA, "llama69m": LLAMA_69M}
FOLDERS = {"llama67m": "/tmp/az_user_load_llama", "llama69m": "/tmp/az_user_load_llama69m"}
ENTRIES = ["initialize", "accelerator", "trainer", "fsdp2", "fsdp2_accelerate", "ds3"]
DS_VENV = Path(__file__).resolve().parents[1] / ".ds-venv"
MB = 1e6
ZERO3: dict = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3},
}


class PhasePeaks:
    """Polls RssAnon and RssFile; `phase(name)` starts a new phase and returns the peaks of the one that ended."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {}
        self.ends: dict[str, dict[str, int]] = {}
        self.current = "baseline"
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def _poll(self) -> None:
        while not self._done.is_set():
            self._record()
            self._done.wait(0.002)

    def _record(self) -> None:
        reading = self.read()
        with self._lock:
            peak = self.peaks.setdefault(self.current, dict(reading))
            for key, value in reading.items():
                peak[key] = max(peak[key], value)

    def phase(self, name: str) -> None:
        self._record()
        with self._lock:
            self.ends[self.current] = self.read()
            self.current = name
        self._record()

    def stop(self) -> dict[str, dict[str, int]]:
        self._done.set()
        self._thread.join()
        self._record()
        self.ends[self.current] = self.read()
        return {"peaks": self.peaks, "ends": self.ends}


def save_model(folder: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes_file = folder / "bench_sizes.json"
    if sizes_file.exists():
        return json.loads(sizes_file.read_text())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.save_pretrained(folder)
    sizes = {
        "params": sum(p.numel() for p in model.parameters()),
        "layer_bytes": sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()),
        "largest_tensor_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
    }
    sizes_file.write_text(json.dumps(sizes))
    return sizes


def write_readings(out: str, result: dict) -> None:
    """Every rank's readings, in rank order, into `out` (rank 0 writes); then the process group ends."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def ds3_worker(args: argparse.Namespace) -> None:
    """DeepSpeed's own way, in its virtualenv: `HfDeepSpeedConfig` alive before `from_pretrained`, so transformers
    builds and loads the model under `zero.Init` (each rank keeps its partition), then `deepspeed.initialize`."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = dict(ZERO3, optimizer={"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}})
    config["zero_optimization"] = dict(ZERO3["zero_optimization"])
    for key in ("stage3_max_reuse_distance", "stage3_max_live_parameters"):  # DeepSpeed takes integers
        if key in config["zero_optimization"]:
            config["zero_optimization"][key] = int(config["zero_optimization"][key])
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (transformers reads it through a weak reference)
    peaks = PhasePeaks()
    baseline = PhasePeaks.read()
    tokens = torch.randint(0, LLAMA["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(rank))
    peaks.phase("load")
    model = AutoModelForCausalLM.from_pretrained(args.folder)
    peaks.phase("init")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for index in range(2):
        peaks.phase(f"forward{index}")
        loss = engine(input_ids=tokens, labels=tokens).loss
        peaks.phase(f"backward{index}")
        engine.backward(loss)
        peaks.phase(f"optimizer{index}")
        engine.step()
    write_readings(args.out, {"rank": rank, "baseline": baseline, **peaks.stop()})


def count_gradient_arenas_whole() -> None:
    """Makes each gradient arena resident when it is allocated, as a device's caching allocator counts it.

    [Note: resident pages against allocated bytes] The arena is `torch.empty` (engine/kept_grads.py): on the CPU its
    pages count in RSS only once written, and the stage-3 backward writes the shard one reduce-scatter at a time,
    so RSS at the start of backward holds a small part of it. A device allocator counts the whole arena from its
    allocation, and so does the estimate (accelerate_zero/debug/phases.py). This run-time wrapper of our own class
    (this benchmark's process only) fills it once at allocation so that RSS measures what a device would hold."""
    from accelerate_zero.engine.kept_grads import GradArena

    take = GradArena.take

    def take_resident(self: GradArena, offset: int, numel: int):
        fresh = self._flat is None
        slot = take(self, offset, numel)
        if fresh:
            self._flat.zero_()
        return slot

    GradArena.take = take_resident


def shard_like_fsdp2(model, reshard: bool, accelerate_policy: bool) -> None:
    """FSDP2 units: `fully_shard` on each decoder layer, then the root (`fsdp2`), or accelerate 1.15's own policy
    (`fsdp2_accelerate`, what `fsdp2_prepare_model` in its `utils/fsdp_utils.py` does for an untied model): the
    decoder layers, the input embedding in its own unit with the same `reshard_after_forward`, the final norm and the
    LM head in one tail unit that is never resharded after forward, and the root with torch's default (not
    resharded either)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    if not accelerate_policy:
        fully_shard(model, reshard_after_forward=reshard)
        return
    fully_shard(model.get_input_embeddings(), reshard_after_forward=reshard)
    fully_shard([model.model.norm, model.get_output_embeddings()], reshard_after_forward=False)
    fully_shard(model)


def worker(args: argparse.Namespace) -> None:
    if args.entry == "ds3":
        ds3_worker(args)
        return
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import accelerate_zero

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.arena_whole:
        count_gradient_arenas_whole()
    # Imported before the baseline, so that no phase counts the modules of the entry point (the Trainer: ~100 MB).
    import datasets  # noqa: F401

    _ = accelerate_zero.ZeroAccelerator, accelerate_zero.Trainer
    peaks = PhasePeaks()
    baseline = PhasePeaks.read()
    batch = {
        "input_ids": torch.randint(0, LLAMA["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(rank))
    }
    batch["labels"] = batch["input_ids"].clone()
    prepared = None
    if args.entry == "trainer":
        training_args = accelerate_zero.TrainingArguments(
            output_dir=str(Path(args.folder) / f"out_{rank}"),
            zero_config=ZERO3,
            per_device_train_batch_size=1,
            max_steps=2,
            learning_rate=1e-4,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
        )
    elif args.entry == "accelerator":
        from accelerate_zero.integrations.accelerate import ZeroPlugin

        config = {key: value for key, value in ZERO3.items() if key != "optimizer"}  # the loop's optimizer
        config.update(gradient_accumulation_steps="auto")
        prepared = accelerate_zero.ZeroAccelerator(ZeroPlugin(config=config), cpu=True)
    peaks.phase("load")
    model = AutoModelForCausalLM.from_pretrained(args.folder)
    peaks.phase("init")
    if args.entry == "initialize":
        engine = accelerate_zero.initialize(model, config=ZERO3)

        def step(index: int) -> None:
            peaks.phase(f"forward{index}")
            loss = engine(**batch).loss
            peaks.phase(f"backward{index}")
            engine.backward(loss)
            peaks.phase(f"optimizer{index}")
            engine.step()

    elif args.entry == "accelerator":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = prepared.prepare(model, optimizer)

        def step(index: int) -> None:
            peaks.phase(f"forward{index}")
            loss = model(**batch).loss
            peaks.phase(f"backward{index}")
            prepared.backward(loss)
            peaks.phase(f"optimizer{index}")
            optimizer.step()
            optimizer.zero_grad()

    elif args.entry in ("fsdp2", "fsdp2_accelerate"):
        reshard = ZERO3["zero_optimization"].get("stage3_max_reuse_distance", 1e9) == 0
        shard_like_fsdp2(model, reshard, accelerate_policy=args.entry == "fsdp2_accelerate")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(index: int) -> None:
            peaks.phase(f"forward{index}")
            loss = model(**batch).loss
            peaks.phase(f"backward{index}")
            loss.backward()
            peaks.phase(f"optimizer{index}")
            optimizer.step()
            optimizer.zero_grad()

    else:
        from datasets import Dataset

        rows = [{"input_ids": batch["input_ids"][0].tolist(), "labels": batch["labels"][0].tolist()}] * 4
        trainer = accelerate_zero.Trainer(model=model, args=training_args, train_dataset=Dataset.from_list(rows))

    # (the user keeps `model`: the engine holds the same module)
    if args.entry == "trainer":
        peaks.phase("train")  # the Trainer builds the engine inside train()
        trainer.train()
    else:
        for index in range(2):
            step(index)
    write_readings(args.out, {"rank": rank, "baseline": baseline, **peaks.stop()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--entries", nargs="+", default=ENTRIES, choices=ENTRIES)
    parser.add_argument("--shape", default="llama67m", choices=sorted(SHAPES), help="the Llama (default: issue 31's)")
    parser.add_argument("--folder", default=None, help="where the model is saved (default: one folder per shape)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--entry", default="initialize", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--zero", default="{}", help="JSON merged into zero_optimization (e.g. reuse distance)")
    parser.add_argument(
        "--arena_whole",
        action="store_true",
        help="count each gradient arena whole from its allocation, as a device allocator does (see the note)",
    )
    args = parser.parse_args()
    ZERO3["zero_optimization"].update(json.loads(args.zero))
    LLAMA.update(SHAPES[args.shape])  # the shape every function here reads
    args.folder = args.folder or FOLDERS[args.shape]
    if args.worker:
        worker(args)
        return
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = save_model(folder)
    state = 16 * sizes["params"] / args.world_size
    print(
        f"model: {sizes['params'] / 1e6:.1f}M parameters; state per rank (16 B/param / {args.world_size}): "
        f"{state / MB:.0f} MB; one layer {sizes['layer_bytes'] / MB:.1f} MB, largest tensor "
        f"{sizes['largest_tensor_bytes'] / MB:.1f} MB"
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    results = {"sizes": sizes, "world_size": args.world_size, "entries": {}}
    for entry in args.entries:
        out = folder / f"result_{entry}.json"
        if entry == "ds3" and not (DS_VENV / "bin" / "python").exists():
            print(f"\nds3: skipped, no DeepSpeed virtualenv at {DS_VENV} (bench/ds_venv.py says how to make it)")
            continue
        python = str(DS_VENV / "bin" / "python") if entry == "ds3" else sys.executable
        command = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.world_size}",
        ]
        command += [__file__, "--worker", "--entry", entry, "--folder", str(folder), "--out", str(out)]
        command += ["--zero", args.zero, "--shape", args.shape] + (["--arena_whole"] if args.arena_whole else [])
        subprocess.run(command, env=env, check=True)
        ranks = json.loads(out.read_text())
        results["entries"][entry] = ranks
        print(f"\n{entry}: peak above the baseline per rank, MB (anonymous / file-backed), max over ranks")
        for phase in ranks[0]["peaks"]:
            if phase == "baseline":
                continue
            anon = max(r["peaks"][phase]["RssAnon"] - r["baseline"]["RssAnon"] for r in ranks)
            file = max(r["peaks"][phase]["RssFile"] - r["baseline"]["RssFile"] for r in ranks)
            end = max(r["ends"][phase]["RssAnon"] - r["baseline"]["RssAnon"] for r in ranks)
            print(
                f"  {phase:8s} peak anon {anon / MB:7.1f}  file {file / MB:7.1f}  (anon / state {anon / state:4.2f});"
                f"  anon at its end {end / MB:7.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
