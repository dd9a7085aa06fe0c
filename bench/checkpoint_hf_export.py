"""Host memory per rank of a Hugging Face export: the rank-0 path (`save_16bit_model`) against the parallel one
(`save_pretrained_parallel`, [Note: parallel Hugging Face export] in accelerate_zero/checkpoint/hf_export.py) (issue 43).

Usage:
    .venv/bin/python bench/checkpoint_hf_export.py                  # 2 ranks, a 29 M-parameter Llama at stage 3, ~1 min
    .venv/bin/python bench/checkpoint_hf_export.py --world_size 4 --hidden 1024 --layers 8

Each mode runs in fresh gloo processes (so the allocator's cached memory of one mode does not hide the other's): a
Llama (vocab 8000, untied) at stage 3 with `stage3_gather_16bit_weights_on_model_save`, then the export in fp32 into a
temporary folder, while a thread samples every 5 ms each rank's resident memory (/proc/self/status VmRSS) above its
level before the export (MALLOC_MMAP_THRESHOLD_=128 KiB, so that freed large blocks leave the resident set). Prints
per rank the peak and the seconds the export took.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _rank(rank: int, world_size: int, port: int, mode: str, args: argparse.Namespace, results: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import accelerate_zero
    from accelerate_zero.checkpoint.hf_export import save_pretrained_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": zero}
    )
    folder = tempfile.mkdtemp(prefix=f"hf_export_{mode}_")
    numel = sum(t.numel() for t in engine.meta_state_dict().values())
    base, peak, stop = _rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if mode == "rank0":
        engine.save_16bit_model(folder)
    else:
        save_pretrained_parallel(engine, folder, max_shard_bytes=args.shard_mib * 2**20)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    results[(mode, rank)] = (peak[0] - base, seconds, size, numel)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard_mib", type=int, default=16)
    args = parser.parse_args()
    # Large blocks from mmap, returned to the system when freed: VmRSS then follows the live memory (glibc's dynamic
    # threshold would otherwise keep freed blocks of a gathered parameter's size in the heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))
    manager = mp.Manager()
    results = manager.dict()
    for index, mode in enumerate(("rank0", "parallel")):
        mp.spawn(_rank, args=(args.world_size, 29650 + index, mode, args, results), nprocs=args.world_size)
    size, numel = results[("rank0", 0)][2], results[("rank0", 0)][3]
    print(
        f"Llama {numel / 1e6:.1f} M parameters, {size / 2**20:.0f} MiB of fp32 weights, {args.world_size} ranks, stage 3"
    )
    print("| export | rank | host memory above the start, peak | seconds |")
    print("|---|---|---|---|")
    for mode in ("rank0", "parallel"):
        for rank in range(args.world_size):
            peak, seconds, _, _ = results[(mode, rank)]
            print(f"| {mode} | {rank} | {peak / 2**20:.0f} MiB | {seconds:.2f} |")


if __name__ == "__main__":
    main()
