"""Parameter shapes of a model that is never allocated: from a transformers config or from safetensors headers.

A config becomes a model on the meta device (`AutoModelForCausalLM.from_config` under `torch.device("meta")`):
its parameters have shapes but no storage, so a 70B model costs nothing, and tied weights, `_no_split_modules`
and the module tree are the real ones. A folder with only `*.safetensors` files is read from the headers (the
first bytes of each file) and rebuilt as a tree of meta modules, one per dotted name prefix; the numbered
children of a container (`model.layers.0`, `model.layers.1`, ...) become the stage 3 gather units, which is what
`_no_split_modules` names for transformers decoders, and so do the embeddings, as the engine makes them units of
their own ([Note: embeddings are units of their own] in engine/stage3/units.py): found as the modules outside the
numbered blocks whose 2-D weight has the most rows (the vocabulary), the first the input embeddings, the last the
LM head.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accelerate_zero.config.schema import ZeroOptimizationConfig
from accelerate_zero.debug.estimate import Architecture, ModelShapes, shapes_from_module


# safetensors dtype names of floating-point tensors (integer ones are quantized, frozen weights: not trained).
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}


@dataclass(frozen=True)
class LoadedModel:
    """A model on the meta device, and how it was found."""

    module: nn.Module
    """Parameters on the meta device: shapes without storage."""
    source: str
    """"config" (a transformers config built on the meta device) or "safetensors" (file headers)."""
    name: str
    """The model class, or the folder."""
    architecture: Architecture | None
    """For the activation estimate; None when the config does not say (or there is none)."""

    def shapes(self, zero: ZeroOptimizationConfig) -> ModelShapes:
        """The estimate's view of the model, with the stage 3 layout `zero`'s thresholds give."""
        return shapes_from_module(self.module, zero, architecture=self.architecture)


class _NumberedBlock(nn.Module):
    """A numbered child of a container rebuilt from safetensors names: one stage 3 gather unit."""


class _RebuiltModel(nn.Module):
    """The root of a tree rebuilt from safetensors names: it answers the questions stage 3 asks a transformers
    model (`_no_split_modules`, its embeddings), from the names and shapes alone (see the module docstring)."""

    _no_split_modules = [_NumberedBlock.__name__]

    def _vocabulary_modules(self) -> list[nn.Module]:
        inside = {id(m) for block in self.modules() if isinstance(block, _NumberedBlock) for m in block.modules()}
        candidates = [
            module
            for module in self.modules()
            if id(module) not in inside
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and module.weight.dim() == 2
        ]
        rows = max((m.weight.shape[0] for m in candidates), default=0)
        return [m for m in candidates if m.weight.shape[0] == rows]

    def get_input_embeddings(self) -> nn.Module | None:
        found = self._vocabulary_modules()
        return found[0] if found else None

    def get_output_embeddings(self) -> nn.Module | None:
        found = self._vocabulary_modules()
        return found[-1] if len(found) > 1 else None


def load_from_config(path: str | Path) -> LoadedModel:
    """Builds the model of a transformers config (a config.json file or a folder holding one) on the meta device.

    Raises:
        ValueError: the config cannot be read or transformers cannot build a model from it.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"cannot read a transformers config from {str(path)!r}: {error}") from error
    model = _meta_model(config)
    return LoadedModel(module=model, source="config", name=type(model).__name__, architecture=architecture_of(config))


def _meta_model(config: Any) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    errors = []
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except (ValueError, KeyError, TypeError, NotImplementedError) as error:
            errors.append(f"{auto.__name__}: {error}")
    raise ValueError(
        f"transformers cannot build a {type(config).__name__} ({getattr(config, 'model_type', '?')}) model: "
        + "; ".join(errors)
    )


def architecture_of(config: Any) -> Architecture | None:
    """Hidden size, layers, heads and vocabulary of a transformers config (its text part); None if one is missing."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = [getattr(text, key, None) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads")]
    values.append(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None))
    if not all(isinstance(v, int) and v > 0 for v in values):
        return None
    hidden, layers, heads, vocab = values
    return Architecture(hidden_size=hidden, num_layers=layers, num_heads=heads, vocab_size=vocab)


def load_from_folder(folder: str | Path) -> LoadedModel:
    """A local model folder: its config.json when transformers can build it, else its safetensors headers.

    Raises:
        ValueError: the folder has neither a usable config.json nor *.safetensors files.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--model {str(folder)!r} is not a folder")
    problem = None
    if (folder / "config.json").is_file():
        try:
            return load_from_config(folder)
        except ValueError as error:
            problem = error
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        reason = f" ({problem})" if problem else ""
        raise ValueError(f"{str(folder)!r} has no usable config.json{reason} and no *.safetensors files")
    model = module_from_shapes(safetensors_shapes(files))
    return LoadedModel(module=model, source="safetensors", name=str(folder), architecture=None)


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every floating-point tensor in the files' headers (nothing else is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] in _FLOAT_DTYPES:
                shapes[name] = tuple(info["shape"])
    return shapes


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def module_from_shapes(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A tree of meta-device modules with one parameter per dotted name, in natural order (layer 2 before 10)."""
    tree: dict[str, Any] = {}
    for name in sorted(shapes, key=_natural_key):
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = shapes[name]
    return _build(tree, numbered=False, root=True)


def _build(tree: dict[str, Any], numbered: bool, root: bool = False) -> nn.Module:
    children = [key for key, value in tree.items() if isinstance(value, dict)]
    container = bool(children) and len(children) == len(tree) and all(key.isdigit() for key in children)
    module: nn.Module
    if root:
        module = _RebuiltModel()
    else:
        module = nn.ModuleDict() if container else (_NumberedBlock() if numbered else nn.Module())
    for key, value in tree.items():
        if isinstance(value, dict):
            module.add_module(key, _build(value, numbered=container))
        else:
            module.register_parameter(key, nn.Parameter(torch.empty(value, device="meta")))
    return module
