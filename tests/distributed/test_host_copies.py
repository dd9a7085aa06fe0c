"""Offload copies: one per bucket per reduction, and the rules of [Note: asynchronous host copies] kept.

On CPU every copy is synchronous, so a read before `wait()` or a write to a source in flight would go unnoticed.
`DeferredCopies` makes them visible: a copy to the host lands only when it is waited for (a read before that sees
stale values and the training drifts from the reference), and every copy checks at completion that its source was
not written while it was in flight (it raises, naming the copy). Training under it must equal training with
immediate copies bit for bit, and a one-process reference to fp32 rounding; so must the CPU device's own path, which
folds each slice into host memory in place ([Note: the host is the device] in engine/host_copies.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from accelerate_zero.engine.host_copies import CopyDone, HostCopies
from accelerate_zero.engine.host_grads import HostGradient
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_batches, make_model, max_param_diff, train_reference


STEPS, PER_RANK_BATCH = 3, 2


class _DeferredCopy(CopyDone):
    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[], None]) -> None:
        super().__init__()
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def done(self) -> bool:
        return self._finish is None


class SeparateMemoryCopies(HostCopies):
    """Copies for a device with memory of its own: every gradient slice takes the path of copies and staging
    ([Note: the host is the device] in engine/host_copies.py), here completing at once."""

    @property
    def host_is_device(self) -> bool:
        return False


class DeferredCopies(SeparateMemoryCopies):
    """Copies that complete only when waited for (or drained), checking that nobody wrote their source meanwhile."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.in_flight: list[_DeferredCopy] = []

    def _deferred(self, what: str, source: torch.Tensor, land: Callable[[torch.Tensor], None]) -> _DeferredCopy:
        issued = source.detach().clone()

        def finish() -> None:
            if not torch.equal(source, issued):
                raise AssertionError(f"{what}: its source was written while the copy was in flight")
            land(issued)

        copy = _DeferredCopy(finish)
        self.in_flight.append(copy)
        return copy

    def to_host(self, source: torch.Tensor, destination: torch.Tensor) -> CopyDone:
        self._count(source)
        return self._deferred("a copy to the host", source, destination.copy_)

    def to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        self._count(source)
        return source.clone(), self._deferred("a copy from a host shard", source, lambda _: None)

    def into_device(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        self._count(source)
        destination.copy_(source)  # the device reads it in stream order; the host must not write `source` yet
        self._deferred("a copy from a host master", source, lambda _: None)

    def drain(self) -> None:
        in_flight, self.in_flight = self.in_flight, []
        for copy in in_flight:
            copy.wait()


def _config(stage: int, accumulation: int, param_offload: bool) -> dict:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 40, "offload_optimizer": {"device": "cpu"}}
    if param_offload:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": PER_RANK_BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }


COPIES = {"in place": HostCopies, "immediate": SeparateMemoryCopies, "deferred": DeferredCopies}


def _train(rank: int, world_size: int, stage: int, accumulation: int, param_offload: bool, copies_kind: str) -> dict:
    import accelerate_zero
    import accelerate_zero.engine.assemble as engine_module

    batches = make_batches(STEPS, accumulation, PER_RANK_BATCH * world_size)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    original = engine_module.HostCopies
    engine_module.HostCopies = COPIES[copies_kind]
    try:
        engine = accelerate_zero.initialize(
            model, optimizer, config=_config(stage, accumulation, param_offload), unit_classes=[nn.Linear]
        )
    finally:
        engine_module.HostCopies = original
    copies = engine.host_copies
    in_host = sum(isinstance(b.kept, HostGradient) for b in engine.reducer.buckets)
    per_step = []
    for step in range(STEPS):
        before = copies.copies
        for micro in range(accumulation):
            x, y = batches.rank_slice(step, micro, rank, world_size)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        per_step.append(copies.copies - before)
    copies.drain()  # completes (and checks) every copy still in flight
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    reference = make_model()
    train_reference(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches, clip=1.0)
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        diff = max_param_diff(model, reference)
    engine.destroy()
    return {"weights": weights, "diff": diff, "copies_per_step": per_step, "host_buckets": in_host}


def _matrix(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        for accumulation in (1, 3):
            for param_offload in (False, True) if stage == 3 else (False,):
                key = f"stage{stage}-acc{accumulation}{'-params' if param_offload else ''}"
                out[key] = {
                    kind: _train(rank, world_size, stage, accumulation, param_offload, kind) for kind in COPIES
                }
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_matrix, request.param, timeout=240)


def test_deferred_copies_train_exactly_like_immediate_ones(results: tuple[int, list[dict]]) -> None:
    _, by_rank = results
    for r in by_rank:
        for key, runs in r.items():
            assert torch.equal(runs["deferred"]["weights"], runs["immediate"]["weights"]), key
            for kind, run in runs.items():
                assert run["diff"] < 2e-6, (key, kind, run["diff"])


def test_one_copy_to_the_host_per_bucket_per_reduction(results: tuple[int, list[dict]]) -> None:
    _, by_rank = results
    for r in by_rank:
        for key, runs in r.items():
            stage, accumulation = int(key[5]), int(key.split("acc")[1][0])
            for kind in ("in place", "immediate"):  # the deferred double counts parameter copies too
                run = runs[kind]
                assert run["host_buckets"] > 1, key  # several buckets, so a per-bucket count is a real check
                # Stages 0/1 reduce once per optimizer step, stages 2/3 on every micro-step (then, under gradient
                # accumulation, through the staging ring, or folded in place on CPU). Copies of parameters between
                # host memory and the compute device are not counted here: on CPU they are the same device.
                expected = run["host_buckets"] * (1 if stage < 2 else accumulation)
                assert run["copies_per_step"] == [expected] * STEPS, (key, kind, run["copies_per_step"], expected)
