"""Host memory per rank of a Hugging Face export: the rank-0 path (`save_16bit_model`) against the parallel one
(`save_pretrained_parallel`, [Note: parallel Hugging Face export] in accelerate_zero/checkpoint/hf_export.py)
(issue 43; bench/README.md, "checkpoint_hf_export.py").

Usage:
    .venv/bin/python bench/checkpoint_hf_export.py          # 2 ranks, a 29 M-parameter Llama at stage 3, ~1 min
    .venv/bin/python bench/checkpoint_hf_export.py --world_size 4 --hidden 1024 --layers 8

Each mode runs in fresh gloo processes; during the export a thread samples each rank's VmRSS every 5 ms above its
level before the export.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import launch, report


def export(mode: str, hidden: int, layers: int, shard_mib: int) -> dict[str, Any]:
    """Rank function: a Llama at stage 3, then its fp32 export `mode` ("rank0" or "parallel"), sampled."""
    import torch
    from harness import models
    from harness.readings import PeakSampler

    import accelerate_zero
    from accelerate_zero.checkpoint.hf_export import save_pretrained_parallel

    model = models.llama(models.llama_config(hidden, layers, vocab=8000, intermediate=hidden * 11 // 4))
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": zero}
    )
    folder = tempfile.mkdtemp(prefix=f"hf_export_{mode}_")
    numel = sum(t.numel() for t in engine.meta_state_dict().values())
    with PeakSampler(("VmRSS",), interval=0.005) as rss:
        base, start = rss.read()["VmRSS"], time.perf_counter()
        if mode == "rank0":
            engine.save_16bit_model(folder)
        else:
            save_pretrained_parallel(engine, folder, max_shard_bytes=shard_mib * 2**20)
        seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    engine.destroy()
    return {"peak": rss.peak["VmRSS"] - base, "seconds": seconds, "size": size, "numel": numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard_mib", type=int, default=16)
    args = parser.parse_args()
    facts, results = report.machine_facts(), {}
    for mode in ("rank0", "parallel"):
        kwargs = {"mode": mode, "hidden": args.hidden, "layers": args.layers, "shard_mib": args.shard_mib}
        results[mode] = launch.on_ranks(args.world_size, export, kwargs, name=mode).results
    first = results["rank0"][0]
    title = (f"checkpoint_hf_export: Llama {first['numel'] / 1e6:.1f} M parameters, {first['size'] / 2**20:.0f} MiB "
             f"of fp32 weights, {args.world_size} ranks, stage 3")  # fmt: skip
    print(report.header(facts, title))
    rows = [(mode, rank, f"{r['peak'] / 2**20:.0f} MiB", f"{r['seconds']:.2f}")
            for mode, ranks in results.items() for rank, r in enumerate(ranks)]  # fmt: skip
    print(report.table(["export", "rank", "host memory above the start, peak", "seconds"], rows, "lrrr"))


if __name__ == "__main__":
    main()
