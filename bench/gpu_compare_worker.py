"""One system, one offload mode, one process: the timed training loop of bench/gpu_compare.py (issue 40).

Usage (what gpu_compare.py runs; the last line printed is the result as JSON):
    python bench/gpu_compare_worker.py --system ours --mode cpu --hidden 2048 --layers 16 --batch 4 --seq 1024 \
        --accumulation 4 --steps 3 --timeline out/timeline_ours_cpu

Every system trains the same LlamaForCausalLM (bench/gpu_compare.py `llama_config`, seed 0) from random weights
built on the compute device in bf16 (fp32 for FSDP2, whose sharded parameters are its fp32 masters), with bf16
compute and fp32 master weights and optimizer state, AdamW (lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight
decay), `gradient_clipping` 1.0 and `--accumulation` micro-steps of `--batch` x `--seq` tokens per optimizer step:
- ours: `accelerate_zero.initialize` at stage 3 with the mode's `offload_optimizer` / `offload_param` blocks.
- deepspeed: `deepspeed.initialize` with the same DeepSpeed config (its own optimizer block: DeepSpeedCPUAdam under
  offload, torch's AdamW without, so no fused_adam build is needed).
- fsdp2: `fully_shard` per decoder layer and at the root, `MixedPrecisionPolicy(bf16, reduce fp32)`,
  `CPUOffloadPolicy` in mode cpu+param (parameters, gradients and the optimizer step on the host: FSDP2 has no
  optimizer-only offload), torch's fused AdamW, `clip_grad_norm_`.
A step is the accumulation micro-steps plus the optimizer step, timed to a device synchronization; the figure is
the median of `--steps` steps after one warm-up step. Readings: tokens/s, TFLOPS as 6 x parameters x tokens / s,
`torch.cuda.max_memory_allocated` over the timed steps (device peak), the process's peak RSS (host peak), and with
`--timeline` one more step under torch.profiler, turned into lanes (bench/gpu_timeline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timeline import lanes_from_trace, write_drawings  # noqa: E402


SYSTEMS = ("ours", "deepspeed", "fsdp2")
MODES = ("none", "cpu", "cpu+param", "nvme")
LR, BETAS, EPS = 1e-5, (0.9, 0.999), 1e-8


def llama_config(hidden: int, layers: int, seq: int) -> Any:
    """LlamaForCausalLM of `layers` x `hidden`: heads of 128 dimensions (fewer when hidden is small), intermediate
    8/3 x hidden rounded to 64, vocabulary 32000, untied head."""
    from transformers import LlamaConfig

    heads = max(1, hidden // 128)
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=64 * max(1, round(hidden * 8 / 3 / 64)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )


def deepspeed_config(args: argparse.Namespace, optimizer_block: bool) -> dict[str, Any]:
    """The DeepSpeed-format config both ours and DeepSpeed read for `args.mode`."""
    zero: dict[str, Any] = {"stage": 3}
    nvme = {"device": "nvme", "nvme_path": args.nvme_dir}
    if args.mode != "none":
        zero["offload_optimizer"] = dict(nvme) if args.mode == "nvme" else {"device": "cpu"}
    if args.mode in ("cpu+param", "nvme"):
        zero["offload_param"] = {**nvme, "max_in_cpu": 0} if args.mode == "nvme" else {"device": "cpu"}
    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.accumulation,
        "zero_optimization": zero,
    }
    if optimizer_block:
        params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0}
        if args.mode == "none":
            params["torch_adam"] = True
        config["optimizer"] = {"type": "AdamW", "params": params}
    return config


def _model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(llama_config(args.hidden, args.layers, args.seq)).to(dtype)


def _init_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=_device_id(device))


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


MicroStep = Callable[[torch.Tensor], torch.Tensor]  # tokens -> loss, after its backward
Boundary = Callable[[], None]  # the optimizer step (ours and DeepSpeed: inside their step() on the boundary)


OURS: dict[str, Any] = {}
"""What ours reports of its schedule when destroyed (added to its result row)."""


def build_ours(args: argparse.Namespace, device: torch.device) -> tuple[MicroStep, Boundary, Callable[[], None]]:
    import accelerate_zero

    model = _model(args, device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    engine = accelerate_zero.initialize(model, optimizer, config=deepspeed_config(args, False), device=device)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("bench::forward"):
            loss = engine(input_ids=tokens, labels=tokens).loss
        with torch.profiler.record_function("bench::backward"):
            engine.backward(loss)
        engine.step()  # the optimizer step runs here on the boundary
        return loss

    def destroy() -> None:
        flight = engine.sharded_optimizer.in_flight  # None: every host step ran inside engine.step()
        OURS["host_step_overlapped"] = flight is not None and flight.launches > 0
        OURS["reads_that_waited_for_the_host_step"] = flight.waits if flight is not None else 0
        engine.destroy()

    return micro, lambda: None, destroy


def build_deepspeed(args: argparse.Namespace, device: torch.device) -> tuple[MicroStep, Boundary, Callable[[], None]]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = _model(args, device, torch.bfloat16)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(args, True)
    )

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("bench::forward"):
            loss = engine(input_ids=tokens, labels=tokens).loss
        with torch.profiler.record_function("bench::backward"):
            engine.backward(loss)
        with torch.profiler.record_function(
            "ZeRO::optimizer_step" if engine.is_gradient_accumulation_boundary() else "bench::micro_end"
        ):
            engine.step()
        return loss

    return micro, lambda: None, lambda: None


def build_fsdp2(args: argparse.Namespace, device: torch.device) -> tuple[MicroStep, Boundary, Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if args.mode not in ("none", "cpu+param"):
        raise NotImplementedError(f"FSDP2 has no offload mode like {args.mode!r} (only CPUOffloadPolicy: cpu+param)")
    model = _model(args, device, torch.bfloat16).float()  # masters on the bf16 grid, as the others start
    mesh = init_device_mesh(device.type, (1,))
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.mode == "cpu+param" else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("bench::forward"):
            loss = model(input_ids=tokens, labels=tokens).loss
        with torch.profiler.record_function("bench::backward"):
            (loss / args.accumulation).backward()
        return loss

    def boundary() -> None:
        with torch.profiler.record_function("ZeRO::optimizer_step"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return micro, boundary, lambda: None


BUILDERS = {"ours": build_ours, "deepspeed": build_deepspeed, "fsdp2": build_fsdp2}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(args: argparse.Namespace, micro: MicroStep, boundary: Boundary, tokens: torch.Tensor) -> float:
    with torch.profiler.record_function("bench::step"):
        for _ in range(args.accumulation):
            loss = micro(tokens)
        boundary()
    return float(loss.detach().float())


def profile_step(args: argparse.Namespace, step: Callable[[], float], device: torch.device) -> dict[str, Any]:
    """One step under torch.profiler, reduced to its lanes; drawings written next to `--timeline`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, experimental_config=_all_threads()) as prof:
        step()  # the previous step: its host step may run into the one drawn (the last `bench::step`)
        step()
        _synchronize(device)
    with tempfile.TemporaryDirectory() as folder:  # a GPU trace of one step is tens of MB: only lanes are kept
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        timeline = lanes_from_trace(json.loads(trace.read_text()))
    stem = Path(args.timeline)
    title = f"{args.system}, {args.mode}: one step of {args.accumulation} x {args.batch} x {args.seq} tokens"
    timeline["drawings"] = [str(p) for p in write_drawings(timeline, f"{title} ({timeline['step_ms']:.0f} ms)", stem)]
    stem.with_suffix(".json").write_text(json.dumps(timeline))
    return {key: timeline[key] for key in ("step_ms", "gpu", "busy", "drawings")}


def measure_figures(device: torch.device, numel: int = 1 << 24) -> dict[str, float]:
    """What `accelerate-zero estimate --copy_gbps --host_rate` takes, measured here: pinned copies of `numel` fp32
    elements each way (GB/s, the mean of both directions), and the fused CPU AdamW step over `numel` elements on
    the threads the engine's host step uses (elements/s)."""
    from accelerate_zero.offload.host_threads import HostThreads, threads_for_rank

    pinned = device.type == "cuda"
    host = torch.ones(numel, pin_memory=pinned)
    on_device = torch.empty(numel, device=device)
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


def _all_threads() -> Any:
    """Profiles every thread (the NVMe reads and writes run on worker threads); None where torch cannot."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _init_process_group(device)
    start = time.perf_counter()
    micro, boundary, destroy = BUILDERS[args.system](args, device)
    setup_seconds = time.perf_counter() - start
    numel = _numel(args)
    tokens = torch.randint(0, 32000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> float:
        return one_step(args, micro, boundary, tokens)

    losses = [step()]
    _synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    # Timed from one step's start to the next's: an offloaded host step may still run when `step()` returns and
    # finish during the next forward ([Note: the host step across the step boundary] in
    # accelerate_zero/engine/step_in_flight.py); one more step ends the last timing (its loss is not kept).
    begins = []
    for index in range(args.steps + 1):
        begins.append(time.perf_counter())
        loss = step()
        _synchronize(device)
        if index < args.steps:
            losses.append(loss)
    times = [b - a for a, b in zip(begins, begins[1:], strict=False)]
    seconds = statistics.median(times)
    step_tokens = args.batch * args.seq * args.accumulation
    result = {
        "system": args.system,
        "mode": args.mode,
        "numel": numel,
        "step_seconds": round(seconds, 4),
        "tokens_per_second": round(step_tokens / seconds, 1),
        "tflops": round(6 * numel * step_tokens / seconds / 1e12, 2),
        "device_peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None,
        "host_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "setup_seconds": round(setup_seconds, 1),
        "losses": [round(v, 4) for v in losses],
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }
    if args.timeline:
        result["timeline"] = profile_step(args, step, device)
    destroy()
    if args.system == "ours":
        result.update(OURS)
        result["measured"] = measure_figures(device)
    return result


def _numel(args: argparse.Namespace) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(llama_config(args.hidden, args.layers, args.seq)).parameters())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme_dir", default=None)
    parser.add_argument("--timeline", default=None, help="path stem for the step's timeline (.svg/.png/.json)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is present (dry run)")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    args.nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="gpu_compare_nvme_")
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
