"""What `engine.compile()` refuses before training, by name (engine/compiling.py), DeepSpeed's `compile` block
(config/compile_block.py), and accelerate's dynamo settings reaching `engine.compile()` (no compiling here: the
compiled runs are tests/distributed/test_compile.py's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.engine.compiling import compile_problems


CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("backend", "kwargs", "stage", "expected"),
    [
        ("inductr", {}, 2, "compile backend 'inductr' is not one torch.compile knows"),
        ("tvm", {}, 2, "needs the package 'tvm', which is not installed"),
        ("cudagraphs", {}, 2, "records CUDA graphs and the model computes on cpu"),
        ("aot_eager", {"mode": "max-autotune"}, 2, "mode 'max-autotune' is a setting of the inductor backend"),
        ("inductor", {"mode": "fastest"}, 2, "compile mode 'fastest' is not one torch knows"),
        ("inductor", {"mode": "reduce-overhead"}, 3, "mode 'reduce-overhead' records CUDA graphs"),
        ("inductor", {"options": {"triton.cudagraphs": True}}, 3, "records CUDA graphs"),
        ("inductor", {"mode": "default", "options": {"a": 1}}, 2, "set both mode and options"),
        ("inductor", {"fullgraf": True}, 2, "compile_kwargs ['fullgraf'] are not torch.compile arguments"),
    ],
)
def test_bad_requests_are_named(backend: str, kwargs: dict, stage: int, expected: str) -> None:
    problems = compile_problems(backend, kwargs, stage=stage, device=CPU)
    assert any(expected in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("backend", "kwargs", "stage"),
    [
        ("inductor", {}, 3),
        ("inductor", {"mode": "max-autotune-no-cudagraphs", "fullgraph": True, "dynamic": False}, 3),
        ("inductor", {"mode": "reduce-overhead"}, 2),  # CUDA graphs are fine where the parameters stay put
        ("aot_eager", {"mode": "default"}, 3),  # accelerate's TorchDynamoPlugin passes mode="default"
        ("eager", {}, 0),
    ],
)
def test_good_requests_pass(backend: str, kwargs: dict, stage: int) -> None:
    assert compile_problems(backend, kwargs, stage=stage, device=CPU) == []


def _engine(stage: int) -> Any:
    import accelerate_zero

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    return accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)


def test_engine_compile_refuses_before_compiling_anything() -> None:
    engine = _engine(3)
    with pytest.raises(ValueError) as error:
        engine.compile(backend="nope", compile_kwargs={"mode": "max-autotune"}, compiled_autograd_enabled=True)
    message = str(error.value)
    for expected in ("backend 'nope'", "mode 'max-autotune'", "compiled_autograd_enabled=True"):
        assert expected in message, message
    with pytest.raises(ValueError, match="schedule is DeepCompile's"):
        engine.compile(schedule=[(0, [])])
    assert not engine.is_compiled and engine.compiled_regions == []
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in engine.module.modules())


def test_engine_compile_compiles_in_place_once() -> None:
    """Stage 3 compiles each unit's module (here the two Linear children; the root unit's code stays eager); the
    same request again is a no-op (as in DeepSpeed), another one is refused."""
    engine = _engine(3)
    engine.compile(backend="eager", compile_kwargs={"backend": "inductor"})  # `backend` wins, with a warning
    assert engine.is_compiled and engine.compiled_regions == ["0", "1"]
    assert engine.module[0]._compiled_call_impl is not None and engine.module._compiled_call_impl is None
    engine.compile(backend="eager")
    with pytest.raises(ValueError, match="compiled already"):
        engine.compile(backend="aot_eager")
    whole = _engine(2)
    whole.compile(backend="eager")
    assert whole.compiled_regions == ["<model>"] and whole.module._compiled_call_impl is not None


def test_deepspeed_compile_block_accepts_defaults_and_refuses_deepcompile() -> None:
    block = {"deepcompile": False, "free_activation": False, "double_buffer": True, "keep_int_input_tensors": True}
    assert ZeroConfig.from_any({"compile": block}).compile.deepcompile is False
    refused = {"deepcompile": True, "offload_opt_states": True, "passes": ["z3"], "autoep_non_moe": True}
    with pytest.raises(ZeroConfigError) as error:
        ZeroConfig.from_any({"compile": refused})
    message = str(error.value)
    for key in refused:
        assert f"compile.{key}=" in message, message
    assert "zero_optimization.offload_optimizer" in message  # what to use instead


def test_accelerate_dynamo_settings_reach_engine_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `--dynamo_backend`/`dynamo_config` (ACCELERATE_DYNAMO_* in each rank's environment),
    `Accelerator(dynamo_backend=...)` and the Trainer's `torch_compile` give `ZeroAccelerator.prepare`."""
    from accelerate.utils import TorchDynamoPlugin

    from accelerate_zero.integrations.accelerate.compile_settings import compile_prepared

    calls = []

    class Engine:
        def compile(self, **kwargs: Any) -> None:
            calls.append(kwargs)

    model = torch.nn.Linear(2, 2)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    compile_prepared(Engine(), model, TorchDynamoPlugin())
    compile_prepared(Engine(), model, TorchDynamoPlugin(backend="inductor", mode="max-autotune", fullgraph=True))
    compile_prepared(Engine(), model, TorchDynamoPlugin(backend="no"))
    user_compiled = torch.compile(model, backend="eager")  # left as it is
    compile_prepared(Engine(), user_compiled, TorchDynamoPlugin(backend="inductor"))
    assert calls == [
        {"backend": "aot_eager", "compile_kwargs": {}, "regional": True},
        {"backend": "inductor", "compile_kwargs": {"mode": "max-autotune", "fullgraph": True}, "regional": True},
    ]


def test_features_inside_the_layers_are_refused_by_name() -> None:
    engine = _engine(2)
    engine.config.sequence_tiling.mlp_tile_tokens = 8  # as a config asking for it would resolve
    with pytest.raises(ValueError, match=r"sequence_tiling cannot be compiled: the tiles' own autograd functions"):
        engine.compile(backend="eager")
    assert not engine.is_compiled
