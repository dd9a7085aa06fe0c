"""Checkpoints: what a save costs training, synchronous against asynchronous; the host memory of a Hugging Face
export on rank 0 against every rank; what verifying a checkpoint costs a loading rank; what `cpu_checkpointing`
takes off the device (bench/README.md, "checkpoints.py").
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import cli, launch, models, report
from harness.readings import PeakSampler


MIB = 2**20


# ------------------------------------------------------------------------------------------- checkpoint_async
def checkpoint_async(
    width: int = 2048, layers: int = 2, batch: int = 256, rounds: int = 5, threads: int = 0, dir: str | None = None
) -> cli.Answer:
    """In each round, interleaved: a step without a save, the step that starts a synchronous save (the call plus
    that step), the one that starts `save_checkpoint(..., async_save=True)` (and the steps while its writer runs),
    the resident memory above its level before the save sampled while the save runs.

    Args:
        width: Linear width.
        layers: Linear layers.
        batch: rows per step.
        rounds: rounds (medians).
        threads: torch intra-op threads (0: torch's default).
        dir: where the checkpoints go (default: the system's temporary folder).
    """
    import torch
    from torch import nn

    import accelerate_zero
    from accelerate_zero.checkpoint import async_save

    launch.single_process_env()
    torch.set_num_threads(threads or torch.get_num_threads())
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                        config={"zero_optimization": {"stage": 1}})  # fmt: skip
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> float:
        start = time.perf_counter()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        return time.perf_counter() - start

    step(), step()  # warm-up: the optimizer state is allocated
    folder = tempfile.mkdtemp(prefix="ckpt_async_", dir=dir)
    times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    calls: dict[str, list[float]] = {"sync": [], "async": []}
    peaks, during = {"sync": 0, "async": 0}, []
    for round_ in range(rounds):  # interleaved, so that a busy neighbour slows every kind alike
        times["none"].append(step())
        for mode in ("sync", "async"):
            with PeakSampler(("VmRSS",), interval=0.005) as rss:
                base, start = rss.read()["VmRSS"], time.perf_counter()
                engine.save_checkpoint(folder, tag=f"{mode}{round_}", async_save=mode == "async")
                calls[mode].append(time.perf_counter() - start)
                times[mode].append(calls[mode][-1] + step())
                while async_save.in_flight(engine) and not (Path(folder) / f"{mode}{round_}").is_dir():
                    during.append(step())
                async_save.finish(engine.layout.world)
            peaks[mode] = max(peaks[mode], rss.peak["VmRSS"] - base)
            times["none"].append(step())
    engine.destroy()
    plain, numel = statistics.median(times["none"]), sum(p.numel() for p in model.parameters())
    rows = [(mode, f"{statistics.median(calls[mode]) * 1e3:.0f} ms", f"{statistics.median(times[mode]) * 1e3:.0f} ms",
             f"{(statistics.median(times[mode]) / plain - 1) * 100:+.1f}%", f"{peaks[mode] / MIB:.0f} MiB")
            for mode in ("sync", "async")]  # fmt: skip
    columns = [
        "save",
        "save call",
        "step that starts a save (call + step)",
        "vs a step",
        "host memory above the start",
    ]
    text = (f"median of {rounds} rounds; a step without a save: {plain * 1e3:.0f} ms\n\n"
            f"{report.table(columns, rows, 'lllll')}")  # fmt: skip
    if during:
        text += f"\n\nsteps while an asynchronous writer ran: {len(during)}, median {statistics.median(during):.3f} s"
    title = (f"checkpoint_async: {numel / 1e6:.1f} M parameters, checkpoint {numel * 12 / MIB:.0f} MiB; batch "
             f"{batch}; {torch.get_num_threads()} torch threads on {os.cpu_count()} cores")  # fmt: skip
    return cli.Answer(title, text, {"times": times, "calls": calls, "peaks": peaks})


# ------------------------------------------------------------------------------------------- checkpoint_hf_export
def export(mode: str, hidden: int, layers: int, shard_mib: int) -> dict[str, Any]:
    """Rank function: a Llama at stage 3, then its fp32 export `mode` (rank0: `save_16bit_model`; parallel:
    `save_pretrained_parallel`), VmRSS sampled every 5 ms above its level before the export."""
    import torch

    import accelerate_zero
    from accelerate_zero.checkpoint.hf_export import save_pretrained_parallel

    model = models.llama(models.llama_config(hidden, layers, vocab=8000, intermediate=hidden * 11 // 4))
    engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config={
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}})  # fmt: skip
    folder = tempfile.mkdtemp(prefix=f"hf_export_{mode}_")
    numel = sum(t.numel() for t in engine.meta_state_dict().values())
    with PeakSampler(("VmRSS",), interval=0.005) as rss:
        base, start = rss.read()["VmRSS"], time.perf_counter()
        if mode == "rank0":
            engine.save_16bit_model(folder)
        else:
            save_pretrained_parallel(engine, folder, max_shard_bytes=shard_mib * MIB)
        seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    engine.destroy()
    return {"peak": rss.peak["VmRSS"] - base, "seconds": seconds, "size": size, "numel": numel}


def checkpoint_hf_export(world_size: int = 2, hidden: int = 512, layers: int = 8, shard_mib: int = 16) -> cli.Answer:
    """Host memory per rank of a Hugging Face export: `save_16bit_model` (rank 0) against
    `save_pretrained_parallel` ([Note: parallel Hugging Face export] in accelerate_zero/checkpoint/hf_export.py).

    Args:
        world_size: ranks, each mode in fresh processes.
        hidden: the Llama's width.
        layers: its decoder layers.
        shard_mib: the parallel export's file size bound.
    """
    results = {}
    for mode in ("rank0", "parallel"):
        kwargs = {"mode": mode, "hidden": hidden, "layers": layers, "shard_mib": shard_mib}
        results[mode] = launch.on_ranks(world_size, export, kwargs, name=mode).results
    first = results["rank0"][0]
    rows = [(mode, rank, f"{r['peak'] / MIB:.0f} MiB", f"{r['seconds']:.2f}")
            for mode, ranks in results.items() for rank, r in enumerate(ranks)]  # fmt: skip
    title = (f"checkpoint_hf_export: Llama {first['numel'] / 1e6:.1f} M parameters, {first['size'] / MIB:.0f} MiB "
             f"of fp32 weights, {world_size} ranks, stage 3")  # fmt: skip
    columns = ["export", "rank", "host memory above the start, peak", "seconds"]
    return cli.Answer(title, report.table(columns, rows, "lrrr"), results)


# ------------------------------------------------------------------------------------------- checkpoint_verify
def checkpoint_verify(files: int = 4, file_mib: int = 512, dir: str | None = None) -> cli.Answer:
    """What verifying costs each loading rank, before and after [Note: each rank verifies what it reads]
    (accelerate_zero/checkpoint/meta.py): sparse files (reading them costs no disk I/O: the hashing alone) hashed
    by `file_digest` one after the other and by `verify_digests` in threads, best of two; then a 70B checkpoint.

    Args:
        files: files written.
        file_mib: their size.
        dir: where (default: the system's temporary folder).
    """
    from accelerate_zero.checkpoint.meta import file_digest, verify_digests

    folder, paths = Path(tempfile.mkdtemp(prefix="verify_", dir=dir)), []
    for rank in range(files):
        paths.append(folder / f"rank{rank:05d}.safetensors")
        with open(paths[-1], "wb") as file:
            file.truncate(file_mib * MIB)
    digests = {path.name: file_digest(path) for path in paths}  # warm-up: the page cache gets the files' pages
    serial = threaded = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for path in paths:
            file_digest(path)
        serial, start = min(serial, time.perf_counter() - start), time.perf_counter()
        if verify_digests(folder, {"files": digests}, paths):
            raise RuntimeError(f"{folder}: the files changed while they were hashed")
        threaded = min(threaded, time.perf_counter() - start)
    for path in paths:
        path.unlink()
    folder.rmdir()
    size = files * file_mib * MIB
    rate, seconds = size / serial / 1e9, 70e9 * 12 / (size / serial)  # 70B: fp32 masters, exp_avg, exp_avg_sq
    rows = [(w, f"{seconds:,.0f}", f"{2 * seconds / w:,.1f}", f"{seconds / w:,.1f}") for w in (8, 64, 512)]
    columns = ["W", "before: every file", "after: own file + rank 0's, one thread", "the same, 2 threads"]
    text = (f"{files} x {file_mib} MiB: one thread {serial:.2f} s ({rate:.2f} GB/s), {files} threads "
            f"{threaded:.2f} s ({size / threaded / 1e9:.2f} GB/s; {os.cpu_count()} cores)\n\n70B checkpoint (840 "
            "GB), seconds of hashing per loading rank at the saved world size W:\n\n")  # fmt: skip
    text += report.table(columns, rows, "rrrr")
    return cli.Answer("checkpoint_verify: hashing a checkpoint on each loading rank", text, {"rate_gbps": rate})


# ------------------------------------------------------------------------------------------- cpu_checkpointing
def saved_activations(
    layers: int, hidden: int, seq: int, batch: int, checkpointing: bool, cpu: bool
) -> dict[str, int]:
    """One process, a Llama in bf16 at stage 3: the bytes autograd saves for backward during one forward, counted
    by saved-tensor hooks around the call (activations, and parameters told by storage), and what the engine's
    hooks inside moved to host memory (`ActivationsToHost.stats`)."""
    import torch

    import accelerate_zero

    model = models.llama(models.llama_config(hidden, layers, vocab=1024, heads=8, kv_heads=4, seq=seq))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ds = {"train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "activation_checkpointing": {"cpu_checkpointing": cpu}}  # fmt: skip
    engine = accelerate_zero.initialize(model, config=ds, device="cpu")
    tokens, counts = torch.randint(0, 1024, (batch, seq)), [0, 0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.untyped_storage().nbytes()}
        counts[tensor.untyped_storage().data_ptr() in params] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = engine(input_ids=tokens, labels=tokens).loss
    stats = engine.activation_offload.stats if engine.activation_offload is not None else None
    out = {"device_activations": counts[0], "device_parameters": counts[1]}
    out.update(host_activations=stats.held_bytes if stats else 0, kept_parameters=stats.kept_bytes if stats else 0)
    engine.backward(loss)
    engine.step()
    out["host_after_backward"] = stats.held_bytes if stats else 0
    engine.destroy()
    return out


def cpu_checkpointing(layers: int = 4, hidden: int = 256, seq: int = 512, batch: int = 2) -> cli.Answer:
    """What `activation_checkpointing.cpu_checkpointing` takes off the device, measured where it is made on the
    CPU (torch.cuda's memory figures do not exist there): the bytes autograd saves during one forward.

    Args:
        layers: the Llama's decoder layers.
        hidden: its width.
        seq: tokens per row.
        batch: rows.
    """
    launch.single_process_env()
    rows = []
    for checkpointing in (False, True):
        for cpu in (False, True):
            m = saved_activations(layers, hidden, seq, batch, checkpointing, cpu)
            params = m["kept_parameters"] if cpu else m["device_parameters"]
            rows.append(("on" if checkpointing else "off", "on" if cpu else "off", f"{m['device_activations']:,}",
                         f"{m['host_activations']:,}", f"{params:,}", f"{m['host_after_backward']:,}"))  # fmt: skip
    columns = ["gradient checkpointing", "cpu_checkpointing", "autograd's activations on the device", "in host memory",
               "parameters' views saved (in place)", "host after backward"]  # fmt: skip
    title = f"cpu_checkpointing: Llama, {layers} layers, hidden {hidden}, batch {batch} x {seq} tokens, bf16, stage 3"
    return cli.Answer(title, report.table(columns, rows, "llrrrr"), rows)


if __name__ == "__main__":
    sys.exit(cli.main(checkpoint_async, checkpoint_hf_export, checkpoint_verify, cpu_checkpointing))
