"""DeepSpeed's `compile` block (0.19.8 `deepspeed/compile/config.py`: its keys and defaults).

In DeepSpeed the block configures DeepCompile, the compiler passes that put ZeRO's gathers and releases into the
compiled graph; nothing is compiled until `engine.compile()` is called, and without `deepcompile: true` every other
key is read by nothing (except `autoep_non_moe`). accelerate_zero compiles with torch.compile around its hooks
instead ([Note: what engine.compile() compiles] in engine/compiling.py), through the same `engine.compile()` (which
accelerate calls when a dynamo backend is set). So the block is accepted as DeepSpeed reads it without DeepCompile:
every key at its default means what it means there, and a key that turns on a DeepCompile feature (or AutoEP's
region compile) is refused by name (config/schema.py REFUSED_FEATURES), with what to use instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from accelerate_zero.config.blocks import Block, _f


@dataclass(kw_only=True)
class CompileConfig(Block):
    """`compile`: DeepSpeed's DeepCompile settings; only their defaults are accepted (see the module docstring)."""

    _PATH: ClassVar[str] = "compile"

    deepcompile: bool = False
    """DeepSpeed: compile ZeRO's collectives into the graph; `true` is refused."""
    autoep_non_moe: bool = False
    """DeepSpeed: compile the parents of AutoEP layers only; `true` is refused."""
    free_activation: bool = False
    free_activation_threshold: int = _f(10 * 1024 * 1024, ge=0)
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[str] | None = None
    """DeepCompile's passes; a list is refused."""


_INSTEAD = (
    "engine.compile(), accelerate's dynamo_backend or TrainingArguments(torch_compile=True) compile the model with "
    "ZeRO's hooks outside the graphs"
)
_DEEPCOMPILE = "DeepCompile is not implemented; " + _INSTEAD
_ONLY_DEEPCOMPILE = "only DeepCompile (compile.deepcompile) reads it, and it is not implemented"
_ALTERNATIVES = {
    "offload_activation": "; activation_checkpointing.cpu_checkpointing keeps activations in host memory",
    "offload_opt_states": "; zero_optimization.offload_optimizer keeps the optimizer states in host memory",
    "offload_parameters": "; zero_optimization.offload_param keeps the parameters in host memory",
}


def compile_refusals() -> dict[str, tuple[Any, str]]:
    """`compile.<key>` -> (the accepted default, why anything else is refused)."""
    defaults = CompileConfig()
    out: dict[str, tuple[Any, str]] = {"compile.deepcompile": (False, _DEEPCOMPILE)}
    out["compile.autoep_non_moe"] = (
        False,
        "it compiles the parents of DeepSpeed's AutoEP layers; engine.compile() at stages 0-2 compiles the whole "
        "model, at stage 3 each unit, and expert parallelism's dispatch runs outside the graphs",
    )
    for key in (f.name for f in dataclasses.fields(CompileConfig)):
        if key not in ("deepcompile", "autoep_non_moe"):
            out[f"compile.{key}"] = (getattr(defaults, key), _ONLY_DEEPCOMPILE + _ALTERNATIVES.get(key, ""))
    return out
