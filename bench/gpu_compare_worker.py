"""One system, one offload mode, one process: the rank function `run` of bench/gpu_compare.py (issue 40).

Every system trains the same LlamaForCausalLM (`llama_config`, seed 0) from random weights built on the compute
device in bf16 (fp32 for FSDP2, whose sharded parameters are its fp32 masters), with bf16 compute, fp32 master
weights and optimizer state, AdamW (lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight decay), `gradient_clipping`
1.0 and `accumulation` micro-steps of `batch` x `seq` tokens per optimizer step:
- ours: `accelerate_zero.initialize` at stage 3 with the mode's `offload_optimizer` / `offload_param` blocks.
- deepspeed: `deepspeed.initialize` with the same config (its own optimizer block: DeepSpeedCPUAdam under offload,
  torch's AdamW without, so no fused_adam build is needed).
- fsdp2: `fully_shard` per decoder layer and at the root, `MixedPrecisionPolicy(bf16, reduce fp32)`,
  `CPUOffloadPolicy` in mode cpu+param (FSDP2 has no optimizer-only offload), torch's fused AdamW, `clip_grad_norm_`.
A step is the micro-steps plus the optimizer step, timed start to start (a host step running into the next step is
counted); the figure is the median of `steps` steps after one warm-up step. Readings: tokens/s, TFLOPS as 6 x
parameters x tokens / s, `torch.cuda.max_memory_allocated` (device peak), the peak RSS (host peak), and with
`timeline` one more step under torch.profiler, turned into lanes (bench/gpu_timeline.py).
"""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_timeline import lanes_from_trace, write_drawings
from harness import launch, models


SYSTEMS = ("ours", "deepspeed", "fsdp2")
MODES = ("none", "cpu", "cpu+param", "nvme")
LR, BETAS, EPS = 1e-5, (0.9, 0.999), 1e-8


def llama_config(hidden: int, layers: int, seq: int, vocab: int = 32000) -> Any:
    """Heads of 128 dimensions (fewer when hidden is small), intermediate 8/3 x hidden rounded to 64."""
    heads = max(1, hidden // 128)
    intermediate = 64 * max(1, round(hidden * 8 / 3 / 64))
    return models.llama_config(hidden, layers, vocab=vocab, intermediate=intermediate, heads=heads, seq=seq)


def deepspeed_config(mode: str, batch: int, accumulation: int, nvme_dir: str | None, optimizer_block: bool) -> dict:
    """The DeepSpeed-format config both ours and DeepSpeed read for `mode`."""
    zero: dict[str, Any] = {"stage": 3}
    nvme = {"device": "nvme", "nvme_path": nvme_dir}
    if mode != "none":
        zero["offload_optimizer"] = dict(nvme) if mode == "nvme" else {"device": "cpu"}
    if mode in ("cpu+param", "nvme"):
        zero["offload_param"] = {**nvme, "max_in_cpu": 0} if mode == "nvme" else {"device": "cpu"}
    config: dict[str, Any] = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero}
    config.update(train_micro_batch_size_per_gpu=batch, gradient_accumulation_steps=accumulation)
    if optimizer_block:
        params = {
            "lr": LR,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": 0.0,
            **({"torch_adam": True} if mode == "none" else {}),
        }
        config["optimizer"] = {"type": "AdamW", "params": params}
    return config


MicroStep = Callable[[torch.Tensor], torch.Tensor]  # tokens -> loss, after its backward
Built = tuple[MicroStep, Callable[[], None], Callable[[], dict[str, Any]]]
"""A micro-step, the boundary's optimizer step (ours and DeepSpeed: inside their step()), and what ends the run
(returning what the system reports of its schedule)."""


def _labelled(name: str, work: Callable[[], Any]) -> Any:
    with torch.profiler.record_function(name):
        return work()


def build_ours(args: dict[str, Any], device: torch.device, model: torch.nn.Module) -> Built:
    import accelerate_zero

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    config = deepspeed_config(args["mode"], args["batch"], args["accumulation"], args["nvme_dir"], False)
    engine = accelerate_zero.initialize(model, optimizer, config=config, device=device)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        loss = _labelled("bench::forward", lambda: engine(input_ids=tokens, labels=tokens).loss)
        _labelled("bench::backward", lambda: engine.backward(loss))
        engine.step()  # the optimizer step runs here on the boundary
        return loss

    def destroy() -> dict[str, Any]:
        flight = engine.sharded_optimizer.in_flight  # None: every host step ran inside engine.step()
        out = {"host_step_overlapped": flight is not None and flight.launches > 0,
               "reads_that_waited_for_the_host_step": flight.waits if flight is not None else 0}  # fmt: skip
        engine.destroy()
        return out

    return micro, lambda: None, destroy


def build_deepspeed(args: dict[str, Any], device: torch.device, model: torch.nn.Module) -> Built:
    import deepspeed

    config = deepspeed_config(args["mode"], args["batch"], args["accumulation"], args["nvme_dir"], True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def micro(tokens: torch.Tensor) -> torch.Tensor:
        loss = _labelled("bench::forward", lambda: engine(input_ids=tokens, labels=tokens).loss)
        _labelled("bench::backward", lambda: engine.backward(loss))
        _labelled(
            "ZeRO::optimizer_step" if engine.is_gradient_accumulation_boundary() else "bench::micro_end", engine.step
        )
        return loss

    return micro, lambda: None, dict


def build_fsdp2(args: dict[str, Any], device: torch.device, model: torch.nn.Module) -> Built:
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
        loss = _labelled("bench::forward", lambda: model(input_ids=tokens, labels=tokens).loss)
        _labelled("bench::backward", lambda: (loss / args["accumulation"]).backward())
        return loss

    def boundary() -> None:
        with torch.profiler.record_function("ZeRO::optimizer_step"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

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
    title = f"{args['system']}, {args['mode']}: one step of {args['accumulation']} x {args['batch']} x "
    title += f"{args['seq']} tokens"
    timeline["drawings"] = [str(p) for p in write_drawings(timeline, f"{title} ({timeline['step_ms']:.0f} ms)", stem)]
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
    start = time.perf_counter()
    config = llama_config(args["hidden"], args["layers"], args["seq"], args.get("vocab", 32000))
    micro, boundary, destroy = BUILDERS[args["system"]](
        args, device, models.llama(config, device=device, dtype=torch.bfloat16)
    )
    setup_seconds = time.perf_counter() - start
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
    step_tokens = args["batch"] * args["seq"] * args["accumulation"]
    result = {
        "system": args["system"], "mode": args["mode"], "numel": numel, "step_seconds": round(seconds, 4),
        "tokens_per_second": round(step_tokens / seconds, 1),
        "tflops": round(6 * numel * step_tokens / seconds / 1e12, 2),
        "device_peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None,
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
