"""`engine.compile()`: torch.compile for an engine's model, the one call every way of asking for compile reaches.

[Note: what engine.compile() compiles]
DeepSpeed's `engine.compile(backend, compile_kwargs)` compiles the model in place (`module.compile(...)`), and
accelerate calls it on a DeepSpeed engine when a dynamo backend is set; here the Trainer's `torch_compile` and
accelerate's `--dynamo_backend` / `dynamo_config` / `Accelerator(dynamo_backend=...)` reach the same call through
`ZeroAccelerator.prepare` (integrations/accelerate/compile_settings.py). What is compiled:
- stages 0-2: the whole model, in place, as DeepSpeed compiles it (no hook of ours runs inside its forward, so a
  decoder-only model is one graph); with accelerate's `use_regional_compilation`, its repeated blocks instead;
- stage 3: each unit's module (a decoder layer) in place, the way torchtitan compiles each block beside FSDP2, and
  nothing else: the hooks that gather, prefetch and release units run around the compiled calls, outside any graph,
  and a decoder layer is one graph with no break. The root unit's own code (embeddings, final norm, head, loss)
  stays eager: compiled, each unit call inside it would break its graph ([Note: compiling around ZeRO's hooks] in
  engine/compile_boundary.py). A model that is one unit compiles whole.
Each compiled region keeps torch.compile's own guards and caches: identical layers share one graph.

Refused before training, by name, with the reason: a backend torch does not know or whose package is missing, a
`mode` the backend does not take, keyword arguments torch.compile does not take; CUDA graphs at stage 3 (they
record the parameters' addresses, which stage 3 frees and gathers again every step); compiled autograd (our
gradient hooks reduce buckets from eager autograd) and DeepCompile's `schedule`; and the features whose
collectives or autograd functions run inside the layers compile would trace (Ulysses, expert parallelism,
sequence tiling: not tested compiled, so refused rather than left to break the graphs inside every layer).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


logger = logging.getLogger(__name__)

DEFAULT_BACKEND = "inductor"
"""DeepSpeed's default on CUDA and CPU accelerators (`get_accelerator().get_compile_backend()`)."""

_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_BACKEND_PACKAGES = {
    "tvm": "tvm",
    "openxla": "torch_xla",
    "openxla_eval": "torch_xla",
    "onnxrt": "onnxruntime",
    "tensorrt": "torch_tensorrt",
    "torch_tensorrt": "torch_tensorrt",
    "ipex": "intel_extension_for_pytorch",
    "hpu_backend": "habana_frameworks",
}
"""Backends torch registers by name whose compiler is another package: without it they fail in the first forward."""


@dataclass(frozen=True)
class CompileRequest:
    """A checked request: the backend and the other keyword arguments of `torch.compile`."""

    backend: str | Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        name = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "a callable")
        return f"backend={name!r}" + "".join(f", {key}={value!r}" for key, value in sorted(self.kwargs.items()))


def compile_problems(
    backend: Any,
    kwargs: dict[str, Any],
    *,
    stage: int,
    device: torch.device,
    features: list[tuple[str, str]] | None = None,
) -> list[str]:
    """Every reason `torch.compile(backend=backend, **kwargs)` cannot run with this engine, each with its fix.

    `features`: (name, why) of the engine's features that cannot be compiled; None: none.
    """
    problems = [f"{name} cannot be compiled: {why}" for name, why in (features or [])]
    problems += _backend_problems(backend, device, stage)
    accepted = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        problems.append(f"compile_kwargs {unknown} are not torch.compile arguments (it takes {sorted(accepted)})")
    mode, options = kwargs.get("mode"), kwargs.get("options")
    if mode is not None and options:
        problems.append("compile_kwargs set both mode and options: torch.compile takes one of them")
    if mode not in (None, "default"):
        problems += _mode_problems(backend, mode, stage)
    if stage == 3 and isinstance(options, dict) and options.get("triton.cudagraphs"):
        problems.append(_CUDAGRAPHS_AT_STAGE3.format(what="options={'triton.cudagraphs': True}"))
    return problems


_CUDAGRAPHS_AT_STAGE3 = (
    "{what} records CUDA graphs, which keep the parameters' addresses, and stage 3 frees every unit's parameters "
    "and gathers them again each step: use mode='max-autotune-no-cudagraphs' or the default mode"
)


def _backend_problems(backend: Any, device: torch.device, stage: int) -> list[str]:
    if callable(backend) and not isinstance(backend, str):
        return []
    if not isinstance(backend, str) or not backend:
        return [f"compile backend {backend!r} must be a backend name or a callable"]
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        listed = ", ".join(name for name in torch._dynamo.list_backends())
        return [f"compile backend {backend!r} is not one torch.compile knows (registered: {listed}, aot_eager, eager)"]
    package = _BACKEND_PACKAGES.get(backend)
    if package is not None and importlib.util.find_spec(package) is None:
        return [f"compile backend {backend!r} needs the package {package!r}, which is not installed: install it"]
    if backend == "cudagraphs":
        if device.type != "cuda":
            return [f"compile backend 'cudagraphs' records CUDA graphs and the model computes on {device}"]
        if stage == 3:
            return [_CUDAGRAPHS_AT_STAGE3.format(what="backend 'cudagraphs'")]
    return []


def _mode_problems(backend: Any, mode: Any, stage: int) -> list[str]:
    if backend != "inductor":
        return [f"compile mode {mode!r} is a setting of the inductor backend, not of {backend!r}: remove it"]
    from torch._inductor import list_mode_options

    known = list(list_mode_options())
    if mode not in known:
        return [f"compile mode {mode!r} is not one torch knows ({', '.join(known)})"]
    if stage == 3 and mode in _CUDAGRAPH_MODES:
        return [_CUDAGRAPHS_AT_STAGE3.format(what=f"mode {mode!r}")]
    return []


def compile_regions(
    module: nn.Module, unit_modules: list[nn.Module], request: CompileRequest, regional: bool
) -> list[str]:
    """Compiles `module` in place as [Note: what engine.compile() compiles] says; returns the regions' names.

    `unit_modules`: stage 3's unit modules other than the root's (empty at stages 0-2). `regional`: at stages 0-2,
    accelerate's regional compilation (its repeated blocks).
    """
    names = {id(sub): name for name, sub in module.named_modules()}
    kwargs = {**request.kwargs, "backend": request.backend}
    if unit_modules:
        regions = unit_modules
    elif regional:
        regions = _repeated_blocks(module)
    else:
        regions = [module]
    for region in regions:
        region.compile(**kwargs)
    return [names.get(id(region), "") or "<model>" for region in regions]


def _repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """accelerate's `compile_regions_deepspeed` rule: the blocks of every ModuleList of one class, else the leaves."""
    from accelerate.utils.other import has_repeated_blocks, is_repeated_blocks

    if is_repeated_blocks(module):
        return list(module)
    if has_repeated_blocks(module):
        return [block for child in module.children() for block in _repeated_blocks(child)]
    return [module]


class CompileAPI:
    """`engine.compile()` and `engine.is_compiled`, DeepSpeed's calls, on `ZeroEngine`; not used on its own."""

    module: nn.Module
    config: Any
    stage: int
    device: torch.device
    units: list[Any]
    scheduler: Any
    experts: Any
    _compiled: CompileRequest | None = None
    compiled_regions: list[str] = []  # noqa: RUF012 - replaced, never mutated
    """The names of the modules `compile()` compiled ("<model>": the whole model)."""

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def compile(
        self,
        backend: str | Callable[..., Any] = DEFAULT_BACKEND,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
        *,
        regional: bool = False,
    ) -> None:
        """Compiles the model in place with `torch.compile` ([Note: what engine.compile() compiles]).

        Args:
            backend: a torch.compile backend name or callable (DeepSpeed's default: "inductor").
            compile_kwargs: torch.compile's other arguments (`mode`, `fullgraph`, `dynamic`, `options`, ...); a
                `backend` among them is overridden by `backend`, with a warning, as DeepSpeed does.
            schedule: DeepCompile's pass schedule; DeepCompile is not implemented, so only None is accepted.
            compiled_autograd_enabled: compile backward with compiled autograd; refused (True).
            regional: stages 0-2: compile the model's repeated blocks instead of the whole model (accelerate's
                `use_regional_compilation`); stage 3 always compiles per unit.

        Raises:
            ValueError: the request cannot run with this engine (every reason listed, each with its fix), or the
                model was compiled already with another request.
        """
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning("The `backend` in `compile_kwargs` is overridden: use the `backend` argument instead.")
            del kwargs["backend"]
        request = CompileRequest(backend, kwargs)
        if self._compiled is not None:
            if self._compiled == request:
                return
            raise ValueError(
                f"the engine's model is compiled already ({self._compiled.describe()}); it cannot be compiled again "
                f"with {request.describe()}"
            )
        problems = compile_problems(
            backend, kwargs, stage=self.stage, device=self.device, features=self._untraceable()
        )
        if schedule is not None:
            problems.append("schedule is DeepCompile's pass schedule, and DeepCompile is not implemented: pass None")
        if compiled_autograd_enabled:
            problems.append(
                "compiled_autograd_enabled=True is not supported: the engine's gradient hooks fill and reduce its "
                "buckets from eager autograd (backward stays eager; the compiled regions' backward is compiled)"
            )
        if problems:
            raise ValueError("engine.compile() refused:\n- " + "\n- ".join(problems))
        units = [unit.module for unit in self.units if unit is not self.scheduler.root] if self.stage == 3 else []
        self.compiled_regions = compile_regions(self.module, units, request, regional)
        self._compiled = request
        logger.info("accelerate_zero: compiled %s (%s)", ", ".join(self.compiled_regions), request.describe())

    def _untraceable(self) -> list[tuple[str, str]]:
        """The engine's features whose work runs inside the layers compile would trace, with why they are refused."""
        config, out = self.config, []
        inside = "run inside every compiled layer, where compiling them is not supported (compile without it)"
        if config.sequence_parallel_size > 1:
            out.append((f"sequence_parallel_size={config.sequence_parallel_size}", f"Ulysses' all-to-alls {inside}"))
        if self.experts is not None:
            out.append(("expert_parallel", f"the token all-to-alls of the split MoE layers {inside}"))
        if config.sequence_tiling.enabled:
            out.append(("sequence_tiling", f"the tiles' own autograd functions {inside}"))
        return out


def uncompiled(module: nn.Module) -> nn.Module:
    """The model inside a `torch.compile(model)` wrapper (the model itself otherwise): the engine shards, names and
    saves the model's own parameters (no `_orig_mod.` in checkpoint keys) while its forward still goes through the
    wrapper, so the compiled graphs run ([Note: compiling around ZeRO's hooks] in engine/compile_boundary.py)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    return module._orig_mod if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule) else module
