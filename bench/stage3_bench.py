"""Stage 3's memory beside DDP, stage 2 and FSDP2: the peak of every phase of every micro-step under gradient
accumulation, and partitioned loading (bench/README.md, "stage3_bench.py").
"""

from __future__ import annotations

import functools
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import cli, launch, models, report
from harness.peers import PEERS
from harness.readings import PeakSampler, count_gradient_arenas_whole, proc_status, reset_peak_rss
from harness.report import Check, fmt, ratio
from harness.steps import runnable, start_measurement
from harness.tensor_peaks import TensorPeaks, build
from harness.summary import MB


OUT = launch.BENCH_DIR / "out" / "stage3_bench"
LLAMA_LAYERS = 4
LLAMA = dict(intermediate=1408, heads=8, vocab=16000)
"""At hidden 512: about 29M parameters (117 MB fp32), untied: the embedding and the LM head are two 33 MB tensors."""


# ------------------------------------------------------------------------------------------------ phases
def phase_peaks(
    system: str, accumulation: int, steps: int, warmup: int, zero: str, arena_whole: bool, live_tensors: bool = False
) -> dict:
    """Rank function: `system` trains the stack; the exact peak of every phase of the timed steps (VmHWM reset when
    a phase starts, read when it ends) and the RSS between micro-steps (after each backward but the boundary's),
    above the baseline; with `live_tensors` the same readings of live tensor bytes beside them ("tensors":
    harness/tensor_peaks.py)."""
    import torch
    import torch.distributed as dist
    from harness import peers
    from torch import nn

    peers.preload(system)
    if arena_whole and system.startswith("az"):
        count_gradient_arenas_whole()
    reset_peak_rss()
    baseline, peaks, between, current = proc_status()["VmHWM"], {}, [0], [None]
    counted = TensorPeaks().start(engine_mappings=system.startswith("az")) if live_tensors else None
    tensors: dict[str, Any] = {"peaks": {}, "between": 0}

    def phase(name: str | None) -> None:
        tensor_peak = counted.phase() if counted is not None else 0
        if current[0] is not None:
            peak = proc_status()["VmHWM"] - baseline
            peaks[current[0]] = max(peaks.get(current[0], peak), peak)
            tensors["peaks"][current[0]] = max(tensors["peaks"].get(current[0], 0), tensor_peak)
        reset_peak_rss()
        current[0] = name

    x, y = models.make_batch(dist.get_rank())
    config = models.engine_config(int(system[-1]) if system[-1].isdigit() else 3, None, accumulation)
    config["zero_optimization"].update(json.loads(zero) if system.endswith("3") else {})
    micros = iter(range(10**9))

    def loss(module: Any) -> torch.Tensor:
        micro = next(micros) % accumulation + 1
        phase(f"forward {micro}")
        value = nn.functional.mse_loss(module(x), y)
        phase(f"backward {micro}")
        return value

    def after_backward(boundary: bool) -> None:
        phase("optimizer" if boundary else None)
        between[0] = between[0] if boundary else max(between[0], proc_status()["VmRSS"] - baseline)
        if counted is not None and not boundary:
            tensors["between"] = max(tensors["between"], counted.live())

    wrapped = peers.build(system, models.build_model(), loss, grad_accum=accumulation, zero_config=config,
                          after_backward=after_backward)  # fmt: skip
    for step in range(warmup + steps):
        if step == warmup:  # the timed steps only (the first step allocates the optimizer state)
            peaks.clear()
            between[0] = 0
            tensors.update(peaks={}, between=0)
        wrapped.step()
        phase(None)
    return {"rank": dist.get_rank(), "peaks": peaks, "between": between[0], "tensors": tensors}


def phases(
    systems: tuple[str, ...] = ("fsdp2", "az3"),
    accumulations: tuple[int, ...] = (1, 4),
    world_size: int = 4,
    steps: int = 3,
    warmup: int = 1,
    zero: str = "{}",
    arena_whole: bool = False,
    live_tensors: bool = False,
    ds_venv: Path = launch.DEFAULT_DS_VENV,
) -> cli.Answer:
    """The peak RSS of every phase of every micro-step (forward, backward, the optimizer step) and between
    micro-steps, against DDP and FSDP2 and against the same system at the first accumulation; the check that stage
    3's peak does not grow with the accumulation.

    Args:
        systems: peers of harness/peers.py, each training the Linear stack (stage 3 under models.STAGE3_KEYS).
        accumulations: micro-steps per optimizer step.
        world_size: processes per group.
        steps: timed optimizer steps.
        warmup: untimed steps before them.
        zero: stage 3: zero_optimization keys over models.STAGE3_KEYS (JSON).
        arena_whole: count the engine's gradient arenas whole from their allocation, as a device allocator does.
        live_tensors: also read the peaks of live torch tensor bytes (a counting CPU allocator, built once): exact,
            and the same rule for every system, collectives' buffers included (harness/tensor_peaks.py).
        ds_venv: DeepSpeed's own virtualenv.
    """
    if live_tensors:
        build()  # once, here: the ranks load what it built
    results = {}
    for accumulation in accumulations:
        for system in runnable(list(systems), ds_venv):
            kwargs = dict(system=system, accumulation=accumulation, steps=steps, warmup=warmup, zero=zero,
                          arena_whole=arena_whole, live_tensors=live_tensors)  # fmt: skip
            python = launch.deepspeed_python(ds_venv) if system.startswith("ds") else None
            name = f"{system}_{accumulation}"
            ranks = launch.on_ranks(world_size, phase_peaks, kwargs, python=python, name=name, out_dir=OUT)
            results[(system, accumulation)] = ranks.results
    rss_table, lines = _phase_table(results, min(accumulations), 1)
    texts = [rss_table, *lines]
    if live_tensors:
        tensors = {key: [r["tensors"] for r in ranks] for key, ranks in results.items()}
        tensor_table, _ = _phase_table(tensors, min(accumulations), 3)
        texts.append(f"Live tensor bytes since the baseline (harness/tensor_peaks.py), MB, max over ranks:\n\n"
                     f"{tensor_table}")
    title = f"stage3_bench phases: W = {world_size}, peak RSS above the baseline per phase (MB, max over ranks)"
    return cli.Answer(title, "\n\n".join(texts), {f"{s}@{a}": r for (s, a), r in results.items()})


def _phase_table(results: dict[tuple[str, int], list[dict]], first: int, digits: int) -> tuple[str, list[str]]:
    """The table of `phases` for one reading ({"peaks", "between"} per rank), and its checks."""
    order = ["forward", "backward", "optimizer"]
    columns = sorted({n for ranks in results.values() for r in ranks for n in r["peaks"]},
                     key=lambda n: (int(n.partition(" ")[2] or 99), order.index(n.partition(" ")[0])))  # fmt: skip
    top = {key: max(max(r["peaks"].values()) for r in ranks) for key, ranks in results.items()}
    rows, lines = [], []
    for (system, accumulation), ranks in results.items():
        peak = top[(system, accumulation)]
        between = "-" if accumulation == 1 else fmt(max(r["between"] for r in ranks) / MB, digits)
        rows.append((system, accumulation,
                     *(fmt(max(r["peaks"].get(c, 0) for r in ranks) / MB, digits) for c in columns),
                     fmt(peak / MB, digits), between, ratio(peak, top.get((system, first))),
                     *(ratio(peak, top.get((peer, accumulation))) for peer in ("ddp", "fsdp2"))))  # fmt: skip
        if system == "az3" and accumulation != first and ("az3", first) in top:
            value = peak / top[("az3", first)]
            name = f"stage 3 peak at accumulation {accumulation} within 10% of accumulation {first}"
            lines.append(
                Check(name, abs(value - 1) <= 0.10, f"{peak / MB:.1f} vs {top[('az3', first)] / MB:.1f} MB").line()
            )
    table = report.table(["system", "accumulation", *columns, "step peak", "between micro-steps",
                          f"/ at accumulation {first}", "/ DDP", "/ FSDP2"], rows)  # fmt: skip
    return table, lines


# ------------------------------------------------------------------------------------------------ loading
def save_llama(folder: str) -> dict[str, Any]:
    """Rank function (one process): saves the Llama once; returns its sizes."""
    sizes_path = Path(folder) / "bench_sizes.json"
    if not sizes_path.exists():
        model = models.llama(models.llama_config(512, LLAMA_LAYERS, **LLAMA))
        model.save_pretrained(folder)
        nbytes = [p.numel() * p.element_size() for p in model.parameters()]
        layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        sizes = {"model_bytes": sum(nbytes), "layer_bytes": layer, "largest_tensor_bytes": max(nbytes)}
        sizes_path.write_text(json.dumps({**sizes, "params": sum(p.numel() for p in model.parameters())}))
    return json.loads(sizes_path.read_text())


def load(system: str, folder: str) -> dict[str, Any]:
    """Rank function: loads `folder` once (load_az3 partitioned, load_hf whole); memory after it and its peaks.
    Both loaders import the same modules before the baseline, so that the reading holds the loading alone."""
    import accelerate  # noqa: F401
    import torch
    from harness.readings import live_tensor_bytes
    from transformers import LlamaForCausalLM

    import accelerate_zero

    measurement = start_measurement()
    with PeakSampler(("RssAnon", "RssFile")) as sampled:  # VmHWM does not split anonymous from file-backed pages
        if system == "load_az3":
            model = accelerate_zero.from_pretrained(LlamaForCausalLM, folder, config=models.engine_config(3))
        else:
            model = LlamaForCausalLM.from_pretrained(folder)
    gc.collect()
    measurement.after = proc_status()
    measurement.extra["sampled_peak"] = sampled.peak
    # transformers may leave parameters as views of the mmap-ed safetensors file, not yet read: touch every one
    # (as the first forward would) and read again.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sum()
    measurement.extra["after_touch"] = proc_status()
    measurement.params = sum(p.numel() for p in model.parameters())
    measurement.live_tensor_bytes = live_tensor_bytes()
    return vars(measurement)


def _most_mb(ranks: list[dict[str, Any]], read: Callable[[dict[str, Any]], float]) -> str:
    return f"{max(read(r) for r in ranks) / MB:.1f}"


def loading(
    world_size: int = 2, folder: Path = Path("/tmp/az_stage3_bench_llama"), overhead_mb: float = 32.0
) -> cli.Answer:
    """A saved ~29M Llama loaded partitioned (`accelerate_zero.from_pretrained`) and whole (transformers): the
    peaks, and the check that the partitioned peak stays under model/W + its largest unit + an overhead.

    Args:
        world_size: processes loading.
        folder: where the Llama is saved once.
        overhead_mb: the overhead allowed in the check.
    """
    folder.mkdir(parents=True, exist_ok=True)
    sizes = launch.on_ranks(1, save_llama, {"folder": str(folder)}, out_dir=OUT, backend="none").results[0]
    raw = {}
    for system in ("load_az3", "load_hf"):
        raw[system] = launch.on_ranks(world_size, load, {"system": system, "folder": str(folder)}, name=system,
                                      out_dir=OUT).results  # fmt: skip
    columns = [
        f"loader (W={world_size})", "peak RSS per rank: VmHWM − baseline (MB, each rank)", "RSS after (MB, max)",
        "anonymous RSS after (MB, max)", "live tensors after (MB, max)", "sampled peak RssAnon − baseline (MB)",
        "sampled peak RssFile − baseline (MB)", "VmHWM − baseline after touching every parameter (MB)",
    ]  # fmt: skip
    peaks, rows = {}, []
    for system, ranks in raw.items():
        per_rank = [(r["after"]["VmHWM"] - r["baseline"]["VmRSS"]) / MB for r in ranks]
        peaks[system], most = max(per_rank), functools.partial(_most_mb, ranks)
        rows.append((
            system, " / ".join(f"{p:.1f}" for p in per_rank),
            most(lambda r: r["after"]["VmRSS"] - r["baseline"]["VmRSS"]),
            most(lambda r: r["after"]["RssAnon"] - r["baseline"]["RssAnon"]), most(lambda r: r["live_tensor_bytes"]),
            most(lambda r: r["extra"]["sampled_peak"]["RssAnon"] - r["baseline"]["RssAnon"]),
            most(lambda r: r["extra"]["sampled_peak"]["RssFile"] - r["baseline"].get("RssFile", 0)),
            most(lambda r: r["extra"]["after_touch"]["VmHWM"] - r["baseline"]["VmRSS"]),
        ))  # fmt: skip
    model_mb, layer_mb, largest_mb = (sizes[k] / MB for k in ("model_bytes", "layer_bytes", "largest_tensor_bytes"))
    rest_mb = model_mb - LLAMA_LAYERS * layer_mb  # what no decoder layer owns: one more unit, read whole
    bound = model_mb / world_size + max(layer_mb, rest_mb) + overhead_mb
    anon = max(r["extra"]["sampled_peak"]["RssAnon"] - r["baseline"]["RssAnon"] for r in raw["load_az3"]) / MB
    checks = [Check(f"partitioned loading peak <= model/W + its largest unit + {overhead_mb:.0f} MB",
                    peaks["load_az3"] <= bound, f"VmHWM − baseline {peaks['load_az3']:.1f} MB vs {bound:.1f} MB "
                    f"(transformers' from_pretrained: {peaks['load_hf']:.1f} MB)"),
              Check("partitioned loading, anonymous memory only (sampled RssAnon peak) <= the same bound",
                    anon <= bound, f"{anon:.1f} vs {bound:.1f} MB; the rest of VmHWM is the page cache")]  # fmt: skip
    text = (f"Model: {sizes['params']:,} parameters = {model_mb:.1f} MB fp32; one decoder layer {layer_mb:.1f} MB; "
            f"largest tensor {largest_mb:.1f} MB; what no decoder layer owns (embedding, LM head, final norm) "
            f"{rest_mb:.1f} MB\n\n{report.table(columns, rows)}\n\n")  # fmt: skip
    text += "\n".join(c.line() for c in checks)
    ok = all(c.passed for c in checks)
    return cli.Answer(f"stage3_bench loading: W = {world_size}", text, {"raw": raw, "sizes": sizes}, ok)


if __name__ == "__main__":
    sys.exit(cli.main(phases, loading, choices={"systems": list(PEERS)}))
