"""The smoke test's checks of loading, offload at scale and the CUDA contexts (tests/gpu/smoke.py runs them).

- `check_loading`: `accelerate_zero.from_pretrained` of a tiny Llama under CPU and NVMe parameter offload: the unit
  shards are read into host memory (never staged on the device), the NVMe run really puts them in files, and both
  train like transformers' own model trained in one process;
- `check_medium`: a Llama of >= 100M parameters at stage 3 in bf16 (on CUDA; a small one on the CPU, so the code
  path stays alive in CI): device memory per phase (init, forward, backward, step, between steps, save) and time
  per step, and the engine's own accounting against what the allocator holds between steps;
- `check_refused_pinning`: a cudaHostRegister the driver refuses falls back to ordinary memory and leaves no error
  behind for the next kernel;
- `check_cuda_contexts`: after every other check, this process holds a CUDA context on its own GPU only (a thread
  that entered a stream without its device would have made one on GPU 0).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from tests.helpers.models import tiny_llama_config, train_causal_lm


SKIPPED = "skipped"
# [Note: the AdamW parity bound against one process] in tests/distributed/test_stage3_loading.py
ADAMW_LR, ADAMW_PARITY_BOUND = 1e-2, 2e-5


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides))


def _shards_on(engine: Any) -> set[str]:
    return {flat.shard.device.type for unit in engine.units for flat in unit.flats if flat.shard.numel()}


def check_loading(rank: int, world_size: int, device: torch.device, folder: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import accelerate_zero

    path = Path(folder) / "llama"
    torch.manual_seed(0)
    _llama().save_pretrained(path, max_shard_size="20KB")  # transformers writes on rank 0 only
    if torch.distributed.is_initialized():  # the earlier checks' engines made the group
        torch.distributed.barrier()
    tokens = torch.randint(0, 64, (2 * world_size, 10), generator=torch.Generator().manual_seed(0)).to(device)
    reference = LlamaForCausalLM.from_pretrained(path).to(device)
    train_causal_lm(reference, tokens, ADAMW_LR, 2)
    expected = [p.detach().float().cpu() for p in reference.parameters()]
    out: dict[str, Any] = {}
    trained = {}
    for home in ("cpu", "nvme"):
        offload = {"device": home, **({"nvme_path": f"{folder}/nvme_load", "max_in_cpu": 0} if home == "nvme" else {})}
        zero = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": offload,
            "offload_optimizer": {"device": "cpu"},
        }
        config = {"gradient_clipping": 1.0, "zero_optimization": zero}
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        model = accelerate_zero.from_pretrained(LlamaForCausalLM, str(path), config=config, device=device)
        staged = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else 0
        engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=ADAMW_LR), config=config)
        swapped = len(getattr(engine.shard_store, "shards", {}))
        flats = sum(len(unit.flats) for unit in engine.units)
        for _ in range(2):
            mine = tokens[2 * rank : 2 * rank + 2]
            engine.backward(engine(input_ids=mine, labels=mine).loss)
            engine.step()
        with accelerate_zero.GatheredParameters(list(model.parameters())):
            trained[home] = [p.detach().float().cpu().clone() for p in model.parameters()]
        on = _shards_on(engine)
        engine.destroy()
        diff = max((a - b).abs().max().item() for a, b in zip(trained[home], expected, strict=True))
        out[f"from_pretrained, offload_param {home}: max |param - one-process reference|"] = (
            diff,
            diff < ADAMW_PARITY_BOUND,
        )
        out[f"from_pretrained, offload_param {home}: unit shards held in"] = (sorted(on), on <= {"cpu"})
        if device.type == "cuda":
            # the shards were read into host memory: the device got at most the persistent parameters and buffers
            numel = sum(p.numel() for p in reference.parameters())
            out[f"from_pretrained, offload_param {home}: device bytes while loading (model: {4 * numel})"] = (
                staged,
                staged < 4 * numel // 2,
            )
        if home == "nvme":
            out["from_pretrained, offload_param nvme: shards in files / flat buffers"] = (
                (swapped, flats),
                0 < swapped == flats,
            )
    same = all(torch.equal(a, b) for a, b in zip(trained["cpu"], trained["nvme"], strict=True))
    out["from_pretrained: CPU and NVMe parameter offload train bit-identically"] = (same, same)
    return out


MEDIUM = dict(  # 134M parameters with its untied 32000-token embeddings and head
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=False)


def check_medium(rank: int, world_size: int, device: torch.device, folder: str) -> dict[str, Any]:
    import accelerate_zero

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = _llama(**(MEDIUM if cuda else SMALL))
    numel = sum(p.numel() for p in model.parameters())
    batch, seq = (4, 512) if cuda else (2, 32)
    config = {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": {"stage": 3},
    }
    phases: dict[str, float] = {}

    def mark(phase: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            phases[phase] = torch.cuda.max_memory_allocated(device) / 2**20
            torch.cuda.reset_peak_memory_stats(device)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    engine = accelerate_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    mark("init")
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank))
    tokens = tokens.to(device)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        mark("forward")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("step")
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    held = engine.memory_breakdown()["total"]
    allocated = torch.cuda.memory_allocated(device) if cuda else 0
    engine.save_checkpoint(f"{folder}/medium")
    mark("save")
    engine.destroy()
    shutil.rmtree(f"{folder}/medium", ignore_errors=True)
    out: dict[str, Any] = {
        f"medium Llama ({numel / 1e6:.0f}M parameters): seconds per step after the first": (
            round(sorted(times[1:])[len(times[1:]) // 2], 4),
            True,
        )
    }
    if not cuda:
        out["medium Llama: peak MiB per phase"] = (SKIPPED, True)
        out["medium Llama: allocated between steps vs memory_breakdown() total"] = (SKIPPED, True)
        return out
    out[f"medium Llama ({numel / 1e6:.0f}M parameters): peak MiB per phase"] = (
        {k: round(v) for k, v in phases.items()},
        True,
    )
    # Between steps the device holds the engine's shards and little else (the model's buffers, CUDA's own blocks).
    out["medium Llama: allocated between steps vs memory_breakdown() total"] = (
        (allocated, held),
        held <= allocated <= 1.1 * held + 64 * 2**20,
    )
    return out


def check_cuda_contexts(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    name = "CUDA contexts of this process: GPUs (expected: its own only)"
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return {name: (SKIPPED, True)}
    own = torch.cuda.get_device_properties(device).uuid
    listed = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    gpus = {
        line.split(",")[1].strip() for line in listed.splitlines() if line.split(",")[0].strip() == str(os.getpid())
    }
    if not gpus:  # inside some containers nvidia-smi cannot see processes: say so rather than pass silently
        return {name: ("nvidia-smi lists no process of ours", True)}
    return {name: (sorted(gpus), gpus == {f"GPU-{own}"})}


def check_refused_pinning(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    from accelerate_zero.offload.host_memory import HostMemory, _cuda_register

    name = "a refused cudaHostRegister: ordinary memory, and the next kernel runs"
    if device.type != "cuda":
        return {name: (SKIPPED, True)}
    pinned = HostMemory(True, chunk_bytes=2**20)
    first = pinned.zeros(16, torch.float32)
    # Registering the same range again is refused (cudaErrorHostMemoryAlreadyRegistered).
    chunk = pinned.chunks[0]
    refused = HostMemory(
        True, chunk_bytes=2**20, register=lambda pointer, size: _cuda_register(chunk.data_ptr(), size)
    )
    buffer = refused.zeros(16, torch.float32)
    try:
        total = (torch.ones(1024, device=device) * 2).sum().item()  # a kernel launch checks the last error
        ran: bool | str = total == 2048
    except RuntimeError as error:
        ran = f"the next kernel failed: {error}"
    fell_back = not refused.pin and not buffer.is_pinned() and first.is_pinned()
    # Why the error is cleared: the same refusal without clearing it, then a kernel (reported, not checked).
    torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), 2**20, 0)
    try:
        (torch.ones(1024, device=device) * 2).sum().item()
        uncleared = "the next kernel ran"
    except RuntimeError as error:
        uncleared = f"the next kernel failed: {str(error)[:120]}"
    pinned.close()
    return {
        name: ((ran, fell_back), ran is True and fell_back),
        "a refused cudaHostRegister left uncleared (reported)": (uncleared, True),
    }
