"""torch.compile with the engine at stages 0-3 against a single-process eager reference, at 2 ranks.

Every way of compiling reaches the model and trains exactly as eager does (fp32, 1e-5): `engine.compile()` at each
stage (stage 3 per unit: no graph break at all, identical decoder layers share one graph), and at stage 3
`torch.compile(model)` after and before `initialize` (the whole model: the graph breaks fall on the unit hooks only,
[Note: compiling around ZeRO's hooks]; both failed before, in backward and in the traced all-gather). The graphs and breaks are counted with dynamo's own
counters; Llama, Qwen3 and a MoE (Qwen3-MoE) at stage 3. The backend is aot_eager: dynamo and AOTAutograd as
inductor runs them, without generating kernels (inductor's speed is bench/compile.py's question).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import ZOO, tiny_llama_config


STEPS, GRAD_ACCUM, PER_RANK_BATCH, SEQ, VOCAB = 2, 2, 2, 10, 64
BACKEND = "aot_eager"
TOLERANCE = 1e-5
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3))
    return ZOO[name].build()


def _batches(world_size: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        [torch.randint(3, VOCAB, (PER_RANK_BATCH * world_size, SEQ), generator=gen) for _ in range(GRAD_ACCUM)]
        for _ in range(STEPS)
    ]


def _reference(name: str, batches: list) -> torch.nn.Module:
    """One process, eager, on the full batch."""
    model = _model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in batches:
        for tokens in step:
            (model(input_ids=tokens, labels=tokens, use_cache=False).loss / GRAD_ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return model


def _lora_with_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model.gradient_checkpointing_enable({"use_reentrant": False})
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


FEATURES: dict[str, dict[str, Any]] = {
    "checkpointing+lora": {},
    "bf16": {"bf16": {"enabled": True}},
    "offload": {
        "zero_optimization": {
            **ZERO3,
            "offload_param": {"device": "cpu", "pin_memory": False},
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
        },
        "activation_checkpointing": {"cpu_checkpointing": True},
    },
}
"""Stage 3 with each feature, compiled against the same engine eager."""


def _train(rank: int, name: str, batches: list, zero: dict, how: str, feature: str = "") -> dict[str, Any]:
    """Trains with the engine, compiled `how` ("" eagerly, with `feature`); returns it and the compile counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import accelerate_zero

    torch._dynamo.reset()
    counters.clear()
    model = _model(name)
    if feature == "checkpointing+lora":
        model = _lora_with_checkpointing(model)
    if how == "torch.compile before":
        model = torch.compile(model, backend=BACKEND)
    config = {"gradient_accumulation_steps": GRAD_ACCUM, "zero_optimization": zero, **FEATURES.get(feature, {})}
    engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config)
    call = model
    if how == "engine.compile":
        engine.compile(backend=BACKEND)
    elif how == "torch.compile after":
        call = torch.compile(model, backend=BACKEND)
    graphs = []
    for step in batches:
        for tokens in step:
            mine = tokens[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH]
            engine.backward(call(input_ids=mine, labels=mine, use_cache=False).loss)
            engine.step()
        graphs.append(counters["stats"]["unique_graphs"])
    breaks = counters["graph_break"]
    return {
        "engine": engine,
        "graphs": graphs,
        "breaks": sum(breaks.values()),
        "broken_at": sorted({m for reason in breaks for m in re.findall(r"function `([\w.]+)`", reason)}),
        "regions": list(engine.compiled_regions),
    }


def _max_diff(engine: Any, reference: torch.nn.Module) -> float:
    import accelerate_zero

    model = engine.module
    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return max(
            (p.detach() - r.detach()).abs().max().item()
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )


def _compile_checks(rank: int, world_size: int, part: str) -> dict[str, Any]:
    batches = _batches(world_size)
    runs: dict[str, tuple[str, dict, str]] = {}
    if part == "stages":
        for stage in (0, 1, 2, 3):
            zero = ZERO3 if stage == 3 else {"stage": stage}
            runs[f"stage {stage}"] = ("llama", zero, "engine.compile")
    elif part == "whole":
        for how in ("torch.compile after", "torch.compile before"):
            runs[how] = ("llama", ZERO3, how)
    elif part == "models":
        for name in ("qwen3", "qwen3-moe"):
            runs[name] = (name, ZERO3, "engine.compile")
    else:
        return _feature_checks(rank, batches)
    references: dict[str, torch.nn.Module] = {}
    out = {}
    for key, (name, zero, how) in runs.items():
        if name not in references:
            references[name] = _reference(name, batches)
        result = _train(rank, name, batches, zero, how)
        result["diff"] = _max_diff(result.pop("engine"), references[name])
        out[key] = result
    return out


def _feature_checks(rank: int, batches: list) -> dict[str, Any]:
    """Each feature compiled and eager: the largest difference of the (gathered) parameters and the counters."""
    import accelerate_zero

    out = {}
    for feature in FEATURES:
        params = []
        for how in ("", "engine.compile"):
            result = _train(rank, "llama", batches, ZERO3, how, feature)
            engine = result.pop("engine")
            with accelerate_zero.GatheredParameters(list(engine.module.parameters())):
                params.append([p.detach().float().clone() for p in engine.module.parameters()])
        result["diff"] = max((a - b).abs().max().item() for a, b in zip(*params, strict=True))
        out[feature] = result
    return out


_RESULTS: dict[str, list[dict[str, Any]]] = {}


def _results(part: str) -> dict[str, Any]:
    if part not in _RESULTS:
        _RESULTS[part] = run_distributed(_compile_checks, 2, part, timeout=600)
    return _RESULTS[part][0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_compile_is_exact_at_every_stage(stage: int) -> None:
    """At stage 3 the first forward runs eagerly (it records the execution order), the second micro-step compiles;
    the next step reuses the graphs."""
    run = _results("stages")[f"stage {stage}"]
    assert run["diff"] < TOLERANCE, run
    assert run["breaks"] == 0, run
    if stage == 3:  # three identical decoder layers, one graph; the root unit's own code stays eager
        assert run["regions"] == ["model.layers.0", "model.layers.1", "model.layers.2"], run
        assert run["graphs"] == [1, 1], run
    else:  # the whole model, one graph
        assert run["regions"] == ["<model>"], run
        assert run["graphs"] == [1, 1], run


@pytest.mark.parametrize("how", ["torch.compile after", "torch.compile before"])
def test_whole_model_compile_at_stage3_breaks_only_at_unit_hooks(how: str) -> None:
    """Each unit's pre-forward hook breaks the graph (before the layer: nothing inside one breaks). The first
    forward compiles under the recording mode ([Note: compiling around ZeRO's hooks]), the second compiles again
    without it (4 breaks each on this model); the next step reuses the graphs. (`model.compile()` compiles the same
    way: the hooks of the module compiled run before dynamo, the nested ones break as here.)"""
    run = _results("whole")[how]
    assert run["diff"] < TOLERANCE, run
    assert run["broken_at"] == ["_PreForward.__call__"], run
    assert run["breaks"] == 8, run
    assert run["graphs"] == [14, 14], run


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_stage3_compile_per_unit_on_other_architectures(name: str) -> None:
    """Untied: the embedding and the head are units of their own; the layers (attention, MLP or the MoE block)
    share one graph, without a break."""
    run = _results("models")[name]
    assert run["diff"] < TOLERANCE, run
    assert run["breaks"] == 0, run
    assert run["regions"] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"], run
    assert run["graphs"] == [3, 3], run


@pytest.mark.parametrize("feature", list(FEATURES))
def test_stage3_compile_with_features_is_exact_against_eager(feature: str) -> None:
    """Gradient checkpointing (non-reentrant) with LoRA, bf16, parameter, optimizer and activation offload:
    compiled per unit, the same training as the same engine eager."""
    run = _results("features")[feature]
    assert run["diff"] < TOLERANCE, run
    assert run["breaks"] == 0, run
    assert run["regions"] and run["graphs"][0] == run["graphs"][1] > 0, run
