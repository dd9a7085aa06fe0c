"""What each rank runs for tests/integration/test_api_surface.py: the accelerate-loop and engine paths (fp16 at stage
3, `DummyOptim`/`DummyScheduler`, `register_external_parameter`, `release_model`, `optimizer_step_was_skipped`),
and the single-process references they are compared with. The Trainer's paths are in api_surface_trainer_checks.py.

The ranks get a torchrun-style environment only. Every model is tests/helpers/models.py's ToyModel (uneven shapes
7 -> 15 -> 15 -> 3) or a variant of it; results are tensors and plain values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.dist import plain_torchrun_environment
from tests.helpers.models import HIDDEN, IN_FEATURES, OUT_FEATURES, make_batches, make_model, train_reference


ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
"""Every parameter sharded, every unit released right after its use (so a missed gather cannot go unnoticed)."""
STEPS, GRAD_ACCUM, MICRO = 5, 2, 4
FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
"""Loss scale 256: no overflow with this model, so the fp16 run and the reference take the same steps."""
# DummyOptim / DummyScheduler: the config's blocks, every value that accelerate fills left "auto".
DUMMY_LR, DUMMY_DECAY, MIN_LR, WARMUP, TOTAL = 1e-2, 0.05, 2e-3, 2, 5
DUMMY_STEPS = TOTAL + 1
"""Warmup, peak, decay and the floor: every branch of the schedule is used by some step."""
OPTIMIZER_BLOCK = {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": "auto"},
}
SCHEDULER_BLOCK = {
    "type": "WarmupDecayLR",
    "params": {
        "warmup_min_lr": MIN_LR,
        "warmup_max_lr": "auto",
        "warmup_num_steps": "auto",
        "total_num_steps": "auto",
        "warmup_type": "linear",
    },
}
SKIP_STEPS, INJECT_STEP = 4, 2
"""optimizer_step_was_skipped: 4 optimizer steps; the last rank's loss is inf on a micro-step of step 2."""


def run_part(rank: int, world_size: int, folder: str, part: str) -> Any:
    """Runs one check of PARTS on this rank; its files go under `<folder>/<part>`."""
    plain_torchrun_environment()
    if part == "fp16":
        return fp16_stage3(rank, world_size, Path(folder) / part)
    if part == "loop":
        from tests.integration.release_checks import asleep_accelerator, release  # they use this module's loops

        return {
            "dummy": dummy_objects(rank, world_size),
            "skipped": step_was_skipped(rank, world_size),
            "release": release(rank, world_size),
            "asleep": asleep_accelerator(rank, world_size, Path(folder) / "asleep"),
        }
    if part == "external":
        return {how: external_parameter(rank, world_size, how) for how in EXTERNAL_CASES}
    raise ValueError(f"{part=} is not one of {PARTS}")


PARTS = ("fp16", "loop", "external")


# ------------------------------------------------------------------------------------------------ fp16 at stage 3
def round_to_fp16(model: nn.Module) -> nn.Module:
    """The model's weights rounded to fp16 and back: where an fp16 run starts from."""
    for param in model.parameters():
        param.data = param.data.half().float()
    return model


def fp16_stage3(rank: int, world_size: int, folder: Path) -> dict[str, Any]:
    """fp16 with loss scaling at stage 3 (engine API, accumulation 2, clipping 1.0); the fp32 masters (from its
    checkpoint) against the fp32 reference from the same fp16-rounded start, as error / update; and what two bugs do
    to that reference ([Note: the bf16 bound at stage 3] in tests/distributed/test_stage3_llama.py, for fp16)."""
    import accelerate_zero
    from accelerate_zero.checkpoint.consolidate import consolidated_state_dict
    from tests.helpers.models import update_error

    batches = make_batches(STEPS, GRAD_ACCUM, MICRO * world_size)
    model = make_model()
    # SGD: Adam's nearly sign-like update turns 16-bit noise on tiny gradients into full-size steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "gradient_clipping": 1.0,
        "zero_optimization": ZERO3,
        "fp16": FP16,
    }
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    for step in range(STEPS):
        for micro in range(GRAD_ACCUM):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(F.mse_loss(engine(x.half()).float(), y))  # fp16 casts inputs only with auto_cast
            engine.step()
    out: dict[str, Any] = {
        "param_dtypes": sorted({str(s.dtype) for u in engine.units for f in u.flats for s in (f.full, f.shard)}),
        "master_dtypes": sorted({str(p.dtype) for g in engine.optimizer.param_groups for p in g["params"]}),
        "skipped": engine.skipped_steps,
        "steps": engine.global_steps,
        "loss_scale": engine.loss_scale,
    }
    engine.save_checkpoint(str(folder), tag="end")
    engine.destroy()
    if rank != 0:
        return out
    start = {k: v.detach().clone() for k, v in round_to_fp16(make_model()).named_parameters()}

    def reference(**bug: Any) -> dict[str, torch.Tensor]:
        ref = round_to_fp16(make_model())
        train_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), batches, **bug)
        return ref.state_dict()

    expected = reference(clip=1.0)
    out["fp16 masters"] = update_error(consolidated_state_dict(folder / "end"), expected, start)
    out["bug: no clip"] = update_error(reference(clip=0.0), expected, start)
    out["bug: a lost micro-step"] = update_error(reference(clip=1.0, lose=(STEPS - 1, 1)), expected, start)
    return out


# --------------------------------------------------------------------------------------- accelerate loops (shared)
def loop_data(world_size: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every micro-batch of every rank, in accelerate's order: micro-step j of the group is rows
    [j * W * MICRO, (j + 1) * W * MICRO) (its dataloader gives rank r the batches r, r + W, ...)."""
    gen = torch.Generator().manual_seed(5)
    rows = steps * GRAD_ACCUM * world_size * MICRO
    return torch.randn(rows, IN_FEATURES, generator=gen), torch.randn(rows, OUT_FEATURES, generator=gen)


def _accelerator(config: dict[str, Any], accumulation: int = GRAD_ACCUM, **kwargs: Any) -> Any:
    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    config = {"gradient_accumulation_steps": "auto", **config}
    return ZeroAccelerator(ZeroPlugin(config=config), gradient_accumulation_steps=accumulation, **kwargs)


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    from accelerate_zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------- DummyOptim / DummyScheduler
def warmup_decay_lr(iteration: int) -> float:
    """DeepSpeed's WarmupDecayLR with linear warmup, written out: the lr after `iteration + 1` scheduler steps
    (iteration -1: before the first), warmup_min_lr=MIN_LR, warmup_max_lr=DUMMY_LR, warmup WARMUP, total TOTAL."""
    if iteration < 0:
        return MIN_LR
    fraction = iteration / WARMUP if iteration < WARMUP else max(0.0, (TOTAL - iteration) / (TOTAL - WARMUP))
    return MIN_LR + (DUMMY_LR - MIN_LR) * fraction


def dummy_reference(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, the full batch: torch's AdamW with the config block's values and the lr of each step set from
    `warmup_decay_lr` (written independently of the package's scheduler), clipping at 1.0."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=MIN_LR, betas=(0.8, 0.99), eps=1e-6, weight_decay=DUMMY_DECAY)
    x, y = loop_data(world_size, steps)
    rows = world_size * MICRO
    for step in range(steps):
        for micro in range(GRAD_ACCUM):
            first = (step * GRAD_ACCUM + micro) * rows
            (F.mse_loss(model(x[first : first + rows]), y[first : first + rows]) / GRAD_ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = warmup_decay_lr(step - 1)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def dummy_objects(rank: int, world_size: int) -> dict[str, Any]:
    """accelerate's documented loop for a DeepSpeed config with optimizer and scheduler blocks: `DummyOptim` and
    `DummyScheduler` passed to prepare, at stage 3; the lr each optimizer step used, and what was built."""
    # accelerate.utils exports them only when deepspeed is installed; this module is importable without it.
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 1.0,
        "zero_optimization": ZERO3,
        "optimizer": OPTIMIZER_BLOCK,
        "scheduler": SCHEDULER_BLOCK,
    }
    accelerator = _accelerator(config)
    model = make_model()
    # A list: prepare reads a DummyOptim's params twice, and a generator (`model.parameters()`) is empty the second
    # time, failing with "an optimizer was passed to prepare() without the model owning all its parameters" (a bug).
    optimizer = DummyOptim(list(model.parameters()), lr=DUMMY_LR, weight_decay=DUMMY_DECAY)
    # accelerate divides total_num_steps by the number of processes (the dataloader's length before sharding).
    scheduler = DummyScheduler(optimizer, total_num_steps=TOTAL * world_size, warmup_num_steps=WARMUP)
    loader = DataLoader(TensorDataset(*loop_data(world_size, DUMMY_STEPS)), batch_size=MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    used, after = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            if accelerator.sync_gradients:
                used.append(optimizer.param_groups[0]["lr"])  # the engine steps inside backward
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                after.append(scheduler.get_last_lr()[0])
    engine = accelerator.zero_engines[0]
    group = engine.optimizer.param_groups[0]
    out = {
        "optimizer": type(engine.optimizer).__name__,
        "hyper": {k: group[k] for k in ("betas", "eps", "weight_decay")},
        "scheduler": type(engine.lr_scheduler).__name__,
        "scheduler_params": dict(engine.config.scheduler.params),
        "used": used,
        "after": after,
        "steps": engine.global_steps,
        "state": _gathered(model),
    }
    accelerator.free_memory()
    return out


# ---------------------------------------------------------------------------------- optimizer_step_was_skipped
def step_was_skipped(rank: int, world_size: int) -> dict[str, Any]:
    """mixed_precision="fp16" at stage 3, AdamW + a torch LambdaLR (accelerate's AcceleratedScheduler); on one micro-
    step of step INJECT_STEP the last rank's loss is inf. After each optimizer step: the flag, the lr, whether this
    rank's fp32 master shard moved, the loss scale."""
    # With a block of its own, as in accelerate: "enabled" left out stays off, and auto_cast is not added.
    fp16 = {**FP16, "enabled": "auto", "auto_cast": True}
    accelerator = _accelerator({"zero_optimization": ZERO3, "fp16": fp16}, mixed_precision="fp16")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    loader = DataLoader(TensorDataset(*loop_data(world_size, SKIP_STEPS)), batch_size=MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def masters() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for g in optimizer.param_groups for p in g["params"]]).clone()

    flags, lrs, moved, scales, before = [], [], [], [], masters()
    for index, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x).float(), y)
            if index == INJECT_STEP * GRAD_ACCUM and rank == world_size - 1:
                loss = loss * float("inf")  # a non-boundary micro-step: the overflow is found at the boundary
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                now = masters()
                flags.append(accelerator.optimizer_step_was_skipped)
                lrs.append(scheduler.get_last_lr()[0])
                moved.append(not torch.equal(now, before))
                scales.append(accelerator.zero_engines[0].loss_scale)
                before = now
    out = {
        "flags": flags,
        "lrs": lrs,
        "moved": moved,
        "scales": scales,
        "skipped": accelerator.zero_engines[0].skipped_steps,
        "fp16": next(model.parameters()).dtype == torch.float16,
    }
    accelerator.free_memory()
    return out


# ------------------------------------------------------------------------------------ register_external_parameter
class BorrowingHead(nn.Module):
    """A head that, once `borrow` is set, also applies a weight another module owns (DeepSpeed's example of
    `register_external_parameter`: not the model's own tying, and only in a branch the first forward does not take)."""

    def __init__(self, lender: nn.Linear) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, OUT_FEATURES)
        self.lender = (lender,)  # a tuple: not a sub-module, the weight stays the lender's
        self.borrow = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.proj(h)
        if self.borrow:
            out = out + F.linear(h, self.lender[0].weight)[..., :OUT_FEATURES]
        return out


class Borrowing(nn.Module):
    """inp -> mid -> head; at stage 3 each child is a gather unit, and `head` reads `mid.weight` once `borrow` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.head = BorrowingHead(self.mid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def borrowing_model() -> Borrowing:
    torch.manual_seed(0)
    return Borrowing()


BORROW_FROM = 2
"""The first step whose forward takes the branch that reads `mid.weight` from `head`."""
EXTERNAL_CASES = ("registered", "unregistered")


def external_reference(batches: Any) -> dict[str, torch.Tensor]:
    model = borrowing_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        model.head.borrow = step >= BORROW_FROM
        (F.mse_loss(model(batches.inputs[step][0]), batches.targets[step][0])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def external_parameter(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Stage 3 training of `Borrowing` with `head` reading `mid.weight` from step BORROW_FROM on; `how`: registered
    with `register_external_parameter` after `initialize`, or not at all (what happens then is the result)."""
    import accelerate_zero

    batches = make_batches(STEPS, 1, MICRO * world_size)
    model = borrowing_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = {"gradient_clipping": 1.0, "zero_optimization": ZERO3}
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    if how == "registered":
        accelerate_zero.register_external_parameter(model.head, model.mid.weight)
    out: dict[str, Any] = {"error": None}
    try:
        for step in range(STEPS):
            model.head.borrow = step >= BORROW_FROM
            x, y = batches.rank_slice(step, 0, rank, world_size)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    except RuntimeError as error:  # raised alike on every rank (no collective is left waiting)
        out["error"] = f"step {step}: {error}"
    else:
        out["state"] = _gathered(model)
    out["attached"] = {u.name: [e.name for e in u.external] for u in engine.units if u.external}
    engine.destroy()
    return out


class RegistersInInit(Borrowing):
    """`Borrowing` that registers the borrowed weight in its own `__init__`, before any engine exists: where
    DeepSpeed documents the call and where transformers' Wav2Vec2, Hubert and WavLM make it."""

    def __init__(self) -> None:
        import accelerate_zero

        super().__init__()
        accelerate_zero.register_external_parameter(self.head, self.mid.weight)


def registered_in_init(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    import accelerate_zero

    batches = make_batches(STEPS, 1, MICRO * world_size)
    torch.manual_seed(0)
    model = RegistersInInit()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = accelerate_zero.initialize(
        model, optimizer, config={"gradient_clipping": 1.0, "zero_optimization": ZERO3}
    )
    for step in range(STEPS):
        model.head.borrow = step >= BORROW_FROM
        x, y = batches.rank_slice(step, 0, rank, world_size)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    state = _gathered(model)
    engine.destroy()
    return state


def dummy_optim_over_a_generator(rank: int, world_size: int) -> str:
    """accelerate's usual pattern, `DummyOptim(model.parameters(), ...)`: a generator, read more than once."""
    from accelerate.utils.deepspeed import DummyOptim

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin

    plain_torchrun_environment()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}, "optimizer": OPTIMIZER_BLOCK}
    accelerator = ZeroAccelerator(ZeroPlugin(config=config))
    model = make_model()
    model, optimizer = accelerator.prepare(model, DummyOptim(model.parameters(), lr=1e-2))
    name = type(optimizer).__name__
    accelerator.release_model(model)
    return name
