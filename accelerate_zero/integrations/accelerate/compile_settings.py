"""accelerate's dynamo settings -> `engine.compile()` ([Note: what engine.compile() compiles] in engine/compiling.py).

accelerate keeps them in `AcceleratorState.dynamo_plugin`, filled from `Accelerator(dynamo_backend=...)` /
`Accelerator(dynamo_plugin=...)`, from `--dynamo_backend`/`--dynamo_mode`/... or an accelerate YAML's
`dynamo_config` (through the ACCELERATE_DYNAMO_* variables its launcher sets), and from the transformers Trainer's
`torch_compile`, `torch_compile_backend` and `torch_compile_mode`. accelerate applies them in `prepare_model`,
which `ZeroAccelerator.prepare` does not run: each model it builds an engine for is compiled here instead, as
accelerate compiles a DeepSpeed engine (`engine.compile(backend=..., compile_kwargs=...)`). A model the user
compiled already is left as it is, as accelerate leaves it.
"""

from __future__ import annotations

import logging
from typing import Any

from accelerate.utils import DynamoBackend, TorchDynamoPlugin, is_compiled_module
from torch import nn

from accelerate_zero.engine.engine import ZeroEngine


logger = logging.getLogger(__name__)


def compile_prepared(engine: ZeroEngine, model: nn.Module, plugin: TorchDynamoPlugin | None) -> None:
    """Compiles `engine`'s model as `plugin` asks (nothing when its backend is "no" or `model` is compiled).

    Raises:
        ValueError: the settings cannot run with this engine (engine/compiling.py names each reason).
    """
    if plugin is None or plugin.backend == DynamoBackend.NO:
        return
    if is_compiled_module(model):
        logger.info("accelerate_zero: the model is compiled already; accelerate's dynamo settings leave it as it is")
        return
    kwargs: dict[str, Any] = plugin.to_kwargs()
    backend = str(kwargs.pop("backend", plugin.backend.value)).lower()
    try:
        engine.compile(backend=backend, compile_kwargs=kwargs, regional=bool(plugin.use_regional_compilation))
    except ValueError as error:
        raise ValueError(
            f"accelerate's dynamo settings ({_describe(plugin)}; from Accelerator(dynamo_backend=...), "
            f"--dynamo_backend / dynamo_config, or TrainingArguments(torch_compile=...)) cannot be used: {error}"
        ) from None


def _describe(plugin: TorchDynamoPlugin) -> str:
    values = plugin.to_dict()
    return ", ".join(f"{key}={value!r}" for key, value in values.items() if value is not None)
