"""One system, one offload mode, one process: the rank function `run` of bench/gpu_compare.py, and one step's lanes
from a torch.profiler trace, drawn as SVG (bench/README.md, "Offload side by side on one GPU").
"""

from __future__ import annotations

import html
import json
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import launch, models


LR, BETAS, EPS = 1e-5, (0.9, 0.999), 1e-8


def llama_config(hidden: int, layers: int, seq: int, vocab: int = 32000) -> Any:
    """Heads of 128 dimensions (fewer when hidden is small), intermediate 8/3 x hidden rounded to 64."""
    heads = max(1, hidden // 128)
    intermediate = 64 * max(1, round(hidden * 8 / 3 / 64))
    return models.llama_config(hidden, layers, vocab=vocab, intermediate=intermediate, heads=heads, seq=seq)


def deepspeed_config(mode: str, batch: int, accumulation: int, nvme_dir: str | None, optimizer_block: bool) -> dict:
    """The DeepSpeed-format config both ours and DeepSpeed read for `mode`."""
    zero: dict[str, Any] = {"stage": 3, **models.offload_zero(mode, nvme_dir)}
    config: dict[str, Any] = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero}
    config.update(train_micro_batch_size_per_gpu=batch, gradient_accumulation_steps=accumulation)
    if optimizer_block:  # DeepSpeed: DeepSpeedCPUAdam under offload, torch's AdamW without (no fused_adam build)
        params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0, "torch_adam": mode == "none"}
        config["optimizer"] = {"type": "AdamW", "params": params}
    return config


# ------------------------------------------------------------------------------------------------ timeline
LANES = ("compute", "device-to-host", "host step", "host-to-device", "file I/O")
COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
STEP_RANGE = "bench::step"

_CPU_RANGES = {
    "bench::forward": "compute",
    "bench::backward": "compute",
    "ZeRO::copy_to_host": "device-to-host",
    "ZeRO::copy_to_device": "host-to-device",
    "ZeRO::optimizer_step": "host step",
    "ZeRO::file_read": "file I/O",
    "ZeRO::file_write": "file I/O",
}


def _lane_of(event: dict[str, Any], gpu: bool) -> str | None:
    category, name = event.get("cat", ""), event.get("name", "")
    if category == "kernel":
        return "compute"
    if category == "gpu_memcpy":
        if "DtoH" in name:
            return "device-to-host"
        if "HtoD" in name:
            return "host-to-device"
        return None
    if category != "user_annotation":
        return None
    lane = _CPU_RANGES.get(name)
    if gpu and lane in ("compute", "device-to-host", "host-to-device"):
        return None  # the GPU's own events say when these ran
    return lane


def _merged(intervals: list[list[float]], gap: float = 0.0) -> list[list[float]]:
    """The intervals sorted, those less than `gap` apart (overlapping ones when 0) joined into one."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def lanes_from_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The lanes of the last `bench::step` range in a chrome trace (`prof.export_chrome_trace`), in milliseconds
    from the step's start: {"step_ms", "gpu", "lanes": {lane: [[start, end], ...]}, "busy": {lane: share}}.

    Raises:
        ValueError: the trace holds no `bench::step` range (the worker did not label its step).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"]
    if not steps:
        raise ValueError(f"no {STEP_RANGE!r} range in the trace: wrap the step in record_function({STEP_RANGE!r})")
    step = max(steps, key=lambda e: e["ts"])
    begin, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    gpu = any(e.get("cat") == "kernel" for e in events)
    found: dict[str, list[list[float]]] = {lane: [] for lane in LANES}
    for event in events:
        lane = _lane_of(event, gpu)
        if lane is None:
            continue
        start, stop = max(float(event["ts"]), begin), min(float(event["ts"]) + float(event["dur"]), end)
        if stop > start:
            found[lane].append([(start - begin) / 1e3, (stop - begin) / 1e3])
    span = (end - begin) / 1e3
    lanes = {lane: _merged(found[lane]) for lane in LANES}
    busy = {lane: round(sum(b - a for a, b in lanes[lane]) / span, 4) if span else 0.0 for lane in LANES}
    return {"step_ms": round(span, 3), "gpu": gpu, "lanes": lanes, "busy": busy}


def svg(timeline: dict[str, Any], title: str, width: int = 1100) -> str:
    """The timeline as a standalone SVG drawing (no dependencies)."""
    left, row, top = 130, 26, 34
    span = timeline["step_ms"] or 1.0
    scale = (width - left - 20) / span
    height = top + row * len(LANES) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13">{html.escape(title)}</text>',
    ]
    for index, (lane, colour) in enumerate(zip(LANES, COLOURS, strict=True)):
        y = top + index * row
        busy = timeline["busy"][lane]
        parts.append(f'<text x="4" y="{y + 15}">{html.escape(lane)} {busy:.0%}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{width - left - 20}" height="{row - 6}" fill="#f2f2f2"/>')
        for start, end in _merged(timeline["lanes"][lane], gap=0.5 / scale):  # thousands of kernels: a few boxes
            w = max((end - start) * scale, 0.5)
            parts.append(
                f'<rect x="{left + start * scale:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{colour}"/>'
            )
    axis = top + row * len(LANES) + 14
    for tick in range(6):
        x = left + (width - left - 20) * tick / 5
        parts.append(f'<text x="{x:.0f}" y="{axis}" text-anchor="middle">{span * tick / 5:.0f} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------ systems
MicroStep = Callable[[torch.Tensor], torch.Tensor]  # tokens -> loss, after its backward
Built = tuple[MicroStep, Callable[[], None], Callable[[], dict[str, Any]]]
"""A micro-step, the boundary's optimizer step (ours and DeepSpeed: inside their step()), and what ends the run
(returning what the system reports of its schedule)."""


class Phases:
    """Labels each phase of a step for the profiler (`bench::forward`, ...) and, while `recording` on a GPU, reads
    the device's peak of each phase (`torch.cuda.max_memory_allocated`, reset when the phase starts; it synchronizes,
    so only an untimed step records)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.recording, self.peak_gib = device, False, {}

    def mark(self, phase: str) -> None:
        """Ends the phase running (its peak kept, the largest over the steps recorded) and starts another."""
        if self.recording and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            self.peak_gib[phase] = max(self.peak_gib.get(phase, 0.0), peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, name: str, work: Callable[[], Any]) -> Any:
        if self.recording and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        with torch.profiler.record_function(name):
            result = work()
        self.mark(name.split("::")[-1])
        return result


def build_ours(args: dict[str, Any], device: torch.device, model: torch.nn.Module, phases: Phases) -> Built:
    import accelerate_zero

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    config = deepspeed_config(args["mode"], args["batch"], args["accumulation"], args["nvme_dir"], False)
    engine = accelerate_zero.initialize(model, optimizer, config=config, device=device)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        loss = phases("bench::forward", lambda: engine(input_ids=tokens, labels=tokens).loss)
        phases("bench::backward", lambda: engine.backward(loss))
        phases("bench::engine_step", engine.step)  # the optimizer step runs here on the boundary
        return loss

    def destroy() -> dict[str, Any]:
        flight = engine.sharded_optimizer.in_flight  # None: every host step ran inside engine.step()
        out = {"host_step_overlapped": flight is not None and flight.launches > 0,
               "reads_that_waited_for_the_host_step": flight.waits if flight is not None else 0}  # fmt: skip
        engine.destroy()
        return out

    return micro, lambda: None, destroy


def build_deepspeed(args: dict[str, Any], device: torch.device, model: torch.nn.Module, phases: Phases) -> Built:
    import deepspeed

    config = deepspeed_config(args["mode"], args["batch"], args["accumulation"], args["nvme_dir"], True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        loss = phases("bench::forward", lambda: engine(input_ids=tokens, labels=tokens).loss)
        phases("bench::backward", lambda: engine.backward(loss))
        phases(
            "ZeRO::optimizer_step" if engine.is_gradient_accumulation_boundary() else "bench::micro_end", engine.step
        )
        return loss

    return micro, lambda: None, dict


def build_fsdp2(args: dict[str, Any], device: torch.device, model: torch.nn.Module, phases: Phases) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if args["mode"] not in ("none", "cpu+param"):
        raise NotImplementedError(
            f"FSDP2 has no offload mode like {args['mode']!r} (only CPUOffloadPolicy: cpu+param)"
        )
    model = model.float()  # masters on the bf16 grid, as the others start
    mesh = init_device_mesh(device.type, (1,))
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args["mode"] == "cpu+param" else OffloadPolicy()
    for module in [*model.model.layers, model]:
        fully_shard(module, mesh=mesh, mp_policy=precision, offload_policy=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        loss = phases("bench::forward", lambda: model(input_ids=tokens, labels=tokens).loss)
        phases("bench::backward", lambda: (loss / args["accumulation"]).backward())
        return loss

    def boundary() -> None:
        def step() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        phases("ZeRO::optimizer_step", step)

    return micro, boundary, dict


BUILDERS = {"ours": build_ours, "deepspeed": build_deepspeed, "fsdp2": build_fsdp2}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(args: dict[str, Any], step: Callable[[], float], device: torch.device) -> dict[str, Any]:
    """One step under torch.profiler, reduced to its lanes; drawings written next to `timeline`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:  # every thread: the NVMe reads and writes run on worker threads
        threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        threads = None
    with profile(activities=activities, experimental_config=threads) as prof:
        step()  # the previous step: its host step may run into the one drawn (the last `bench::step`)
        step()
        _synchronize(device)
    with tempfile.TemporaryDirectory() as folder:  # a GPU trace of one step is tens of MB: only lanes are kept
        prof.export_chrome_trace(f"{folder}/trace.json")
        timeline = lanes_from_trace(json.loads(Path(f"{folder}/trace.json").read_text()))
    stem = Path(args["timeline"])
    title = f"{args['system']}, {args['mode']}: one step of {args['accumulation']} x {args['batch']} x {args['seq']}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".svg").write_text(svg(timeline, f"{title} ({timeline['step_ms']:.0f} ms)"))
    timeline["drawings"] = [str(stem.with_suffix(".svg"))]
    stem.with_suffix(".json").write_text(json.dumps(timeline))
    return {key: timeline[key] for key in ("step_ms", "gpu", "busy", "drawings")}


def measure_figures(device: torch.device, numel: int = 1 << 24) -> dict[str, float]:
    """What `accelerate-zero estimate --copy_gbps --host_rate` takes, measured here: pinned copies of `numel` fp32
    elements each way (GB/s, the mean of both directions), and the fused CPU AdamW step over `numel` elements on
    the threads the engine's host step uses (elements/s)."""
    from accelerate_zero.offload.host_threads import HostThreads, threads_for_rank

    host, on_device = torch.ones(numel, pin_memory=device.type == "cuda"), torch.empty(numel, device=device)
    seconds = []
    for copy in (lambda: on_device.copy_(host, non_blocking=True), lambda: host.copy_(on_device, non_blocking=True)):
        copy()
        _synchronize(device)
        begin = time.perf_counter()
        for _ in range(5):
            copy()
        _synchronize(device)
        seconds.append((time.perf_counter() - begin) / 5)
    master = torch.nn.Parameter(torch.zeros(numel))
    master.grad = torch.full((numel,), 1e-3)
    adam = torch.optim.AdamW([master], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    with HostThreads(threads_for_rank()):
        adam.step()
        begin = time.perf_counter()
        for _ in range(3):
            adam.step()
        step = (time.perf_counter() - begin) / 3
    return {"copy_gbps": round(numel * 4 / statistics.mean(seconds) / 1e9, 2), "host_rate": round(numel / step, 1)}


def run(args: dict[str, Any]) -> dict[str, Any]:
    """Rank function (one process, its own process group: NCCL on a GPU, gloo on the CPU): `args` holds system,
    mode, hidden, layers, batch, seq, accumulation, steps, nvme_dir, timeline (a path stem or None), cpu, vocab."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args["cpu"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    launch.single_process_env()
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if args["system"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    args = dict(args, nvme_dir=args["nvme_dir"] or tempfile.mkdtemp(prefix="gpu_compare_nvme_"))
    start, phases = time.perf_counter(), Phases(device)
    config = llama_config(args["hidden"], args["layers"], args["seq"], args.get("vocab", 32000))
    model = models.llama(config, device=device, dtype=torch.bfloat16)
    micro, boundary, destroy = BUILDERS[args["system"]](args, device, model, phases)
    setup_seconds = time.perf_counter() - start
    phases.recording = True
    phases.mark("setup")
    phases.recording = False
    numel = sum(p.numel() for p in models.llama(config, device="meta").parameters())
    tokens = models.tokens(args["batch"], args["seq"], config.vocab_size, seed=1).to(device)

    def step() -> float:
        with torch.profiler.record_function("bench::step"):
            for _ in range(args["accumulation"]):
                loss = micro(tokens)
            boundary()
        return float(loss.detach().float())

    losses = [step()]
    _synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    # Timed start to start ([Note: the host step across the step boundary] in engine/step_in_flight.py): one more
    # step ends the last timing (its loss is not kept).
    begins = []
    for index in range(args["steps"] + 1):
        begins.append(time.perf_counter())
        loss = step()
        _synchronize(device)
        losses += [loss] if index < args["steps"] else []
    seconds = statistics.median(b - a for a, b in zip(begins, begins[1:], strict=False))
    device_peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None
    phases.recording = True  # one more step, untimed: the device's peak of each phase
    step()
    phases.recording = False
    step_tokens = args["batch"] * args["seq"] * args["accumulation"]
    result = {
        "system": args["system"], "mode": args["mode"], "numel": numel, "step_seconds": round(seconds, 4),
        "tokens_per_second": round(step_tokens / seconds, 1),
        "tflops": round(6 * numel * step_tokens / seconds / 1e12, 2),
        "device_peak_gib": device_peak, "phase_peak_gib": phases.peak_gib,
        "host_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "setup_seconds": round(setup_seconds, 1), "losses": [round(v, 4) for v in losses],
        "torch_threads": torch.get_num_threads(), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }  # fmt: skip
    if args["timeline"]:
        result["timeline"] = profile_step(args, step, device)
    result.update(destroy())
    if args["system"] == "ours":
        result["measured"] = measure_figures(device, 1 << (24 if cuda else 20))  # a CPU only checks the script
    dist.destroy_process_group()
    return result
