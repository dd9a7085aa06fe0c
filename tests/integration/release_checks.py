"""What each rank runs for tests/integration/test_api_surface.py's `release_model` and sleeping-accelerator checks
(the accelerate loops they start from are api_surface_checks.py's), and the single-process reference."""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.models import IN_FEATURES, make_model
from tests.helpers.settle import settled
from tests.integration.api_surface_checks import MICRO, ZERO3, _accelerator, loop_data


def hook_census(model: nn.Module) -> dict[str, int]:
    """Every hook torch can hold on the model's modules and parameters, counted by kind."""
    kinds = (
        "_forward_pre_hooks",
        "_forward_hooks",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_state_dict_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    )
    counts = {kind: sum(len(getattr(m, kind)) for m in model.modules()) for kind in kinds}
    for kind in ("_post_accumulate_grad_hooks", "_backward_hooks"):
        counts[f"param{kind}"] = sum(len(getattr(p, kind) or {}) for p in model.parameters())
    return counts


def _engine_tensors(engine: Any) -> list[torch.Tensor]:
    """The tensors only the engine holds: each unit's full buffer and shard, the fp32 masters, the optimizer state."""
    tensors = [t for unit in engine.units for flat in unit.flats for t in (flat.full, flat.shard)]
    tensors += [p for group in engine.optimizer.param_groups for p in group["params"]]
    tensors += [v for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return tensors


def asleep_accelerator(rank: int, world_size: int, folder: Path) -> dict[str, Any]:
    """Stage 2 through ZeroAccelerator, asleep (`model.offload_states()`): what accelerate's calls say (they once
    killed rank 0 with SIGSEGV), then the same calls after `reload_states()`."""
    accelerator = _accelerator({"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}, 1)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = loop_data(world_size, 1)
    accelerator.backward(F.mse_loss(model(x[rank * MICRO :][:MICRO]), y[rank * MICRO :][:MICRO]))
    optimizer.step()
    calls = {
        "get_state_dict": lambda: accelerator.get_state_dict(model),
        "save_model": lambda: accelerator.save_model(model, str(folder / "model")),
        "save_state": lambda: accelerator.save_state(str(folder / "state")),
    }
    model.offload_states()
    said = {}
    for name, call in calls.items():
        try:
            call()
            said[name] = "no error"
        except RuntimeError as error:
            said[name] = str(error)
    model.reload_states()
    awake = accelerator.get_state_dict(model)
    return {"said": said, "awake_keys": sorted(awake) if awake is not None else None}


def release(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 3: a trained model and a model prepared for inference, then `release_model` on each; what stays
    referenced, what hooks remain, and whether both models work as plain torch modules afterwards."""
    accelerator = _accelerator({"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": ZERO3}, accumulation=1)
    model, frozen = make_model(), make_model(seed=1)
    census = {"model": hook_census(model), "frozen": hook_census(frozen)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, frozen = accelerator.prepare(model, optimizer, frozen)
    x, y = loop_data(world_size, 1)
    x, y = x[rank * MICRO :][:MICRO], y[rank * MICRO :][:MICRO]
    accelerator.backward(F.mse_loss(model(x), y))  # one optimizer step
    # DeepSpeed's engine (what accelerate's prepare returns there) sleeps between rollouts: so does the model here.
    model.offload_states()
    asleep = accelerator.zero_engines[0].memory_breakdown()["total"]
    model.reload_states()
    probe = torch.linspace(-1, 1, 2 * IN_FEATURES).reshape(2, IN_FEATURES)
    with torch.no_grad():
        logits = {"model": model(probe), "frozen": frozen(probe)}
    engines = [weakref.ref(e) for e in accelerator.zero_engines]
    tensors = [weakref.ref(t) for e in accelerator.zero_engines for t in _engine_tensors(e)]
    out: dict[str, Any] = {"hooks_while_prepared": hook_census(model), "hooks_before": census, "asleep": asleep}
    accelerator.release_model(model)
    accelerator.release_model(frozen)
    del optimizer  # the optimizer prepare returned (its wrapper holds the engine, as accelerate's holds its engine)
    # Read once gloo let go of the last collectives' tensors ([Note: gloo keeps a collective's tensors a moment after
    # `wait()` returned] in tests/helpers/settle.py): in 1 of 3 full suites one of the 20 was alive right after a
    # single collection. A tensor the released engine still holds stays alive and fails the check.
    tensors_alive = settled(lambda: sum(ref() is not None for ref in tensors))
    out.update(
        engines_alive=sum(ref() is not None for ref in engines),
        tensors_alive=tensors_alive,
        tensors_tracked=len(tensors),
        hooks_after={"model": hook_census(model), "frozen": hook_census(frozen)},
        prepared_left=len(accelerator.zero_engines),
        sleeps_after=hasattr(model, "offload_states") or hasattr(model, "reload_states"),
        requires_grad=[p.requires_grad for m in (model, frozen) for p in m.parameters()],
        shapes_ok=all(p.shape == r.shape for p, r in zip(model.parameters(), make_model().parameters(), strict=True)),
    )
    with torch.no_grad():
        out["logit_diff"] = max(
            (m(probe) - logits[k]).abs().max().item() for k, m in (("model", model), ("frozen", frozen))
        )
    # The released model trains as a plain torch module: one SGD step on the full batch equals the reference's.
    out["released_state"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    full_x, full_y = loop_data(world_size, 1)
    full_x, full_y = full_x[: world_size * MICRO], full_y[: world_size * MICRO]
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(full_x), full_y).backward()
    plain.step()
    out["plain_step"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["finite"] = all(math.isfinite(p.sum().item()) for p in model.parameters())
    accelerator.free_memory()
    return out


def release_reference(world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: the weights after the prepared step (full batch), and after the plain step that follows."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = loop_data(world_size, 1)
    states = []
    for clip in (True, False):  # the engine clips ("auto" gradient_clipping is 1.0); the plain step does not
        F.mse_loss(model(x[: world_size * MICRO]), y[: world_size * MICRO]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return states[0], states[1]
