"""Offline consolidation: a sharded engine checkpoint -> full weights `from_pretrained` loads (DeepSpeed's
`zero_to_fp32.py`).

Runs in one process without a process group, on any machine: every parameter is assembled from whichever rank
files hold its pieces (fp32 master values for trained parameters, saved shards for frozen ones, whole tensors for
the rest). Nothing but safetensors, JSON and the model's config is read.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch

from accelerate_zero.checkpoint.fragments import whole_key
from accelerate_zero.checkpoint.io import FragmentReader, resolve_tag
from accelerate_zero.checkpoint.meta import read_meta, verify_files


logger = logging.getLogger(__name__)

ENGINE_TAG = "zero_model"
"""Where `ZeroAccelerator.save_state` and the Trainer put the engine state inside a checkpoint folder."""
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "adapter_config.json",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def engine_folder(checkpoint: str | Path) -> Path:
    """The folder holding meta.json and the rank files, from a Trainer/accelerate checkpoint folder, an engine
    `save_dir` (with `latest`), or the engine folder itself.

    Raises:
        FileNotFoundError: nothing there looks like an accelerate_zero checkpoint.
    """
    path = Path(checkpoint)
    for candidate in (path, path / ENGINE_TAG):
        if (candidate / "meta.json").is_file():
            return candidate
        if (candidate / "latest").is_file():
            return resolve_tag(candidate, None)
    raise FileNotFoundError(
        f"{path} is not an accelerate_zero checkpoint: expected meta.json, a `latest` file, or a {ENGINE_TAG}/ folder "
        "(written by engine.save_checkpoint, ZeroAccelerator.save_state or the Trainer's checkpoints)"
    )


def consolidated_state_dict(checkpoint: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every parameter (fp32 master values where the checkpoint has them) and buffer, full, on CPU, cast to `dtype`.

    Shapes come from the checkpoint; at stage 3 (whose parameters were placeholders when saved) from the model
    config next to it (`config.json`, built on the meta device).

    Raises:
        FileNotFoundError: not a checkpoint.
        ValueError: a rank file is missing, or stage-3 shapes are needed and there is no config.json.
    """
    folder = engine_folder(checkpoint)
    meta = read_meta(folder)
    files = verify_files(folder, meta)
    shapes: dict[str, list[int] | None] = meta["param_shapes"]
    skeleton = _meta_model(Path(checkpoint))
    if skeleton is not None:
        real = {n: list(p.shape) for n, p in skeleton.named_parameters()}
        _check_shapes(shapes, real, folder)
        shapes = {n: s if s is not None else real.get(n) for n, s in shapes.items()}
    missing = sorted(n for n, s in shapes.items() if s is None)
    if missing:
        raise ValueError(
            f"the shapes of {len(missing)} parameters (e.g. {missing[0]!r}) are not in {folder}/meta.json (a stage-3 "
            f"checkpoint) and there is no config.json next to it: copy the model's config.json into {checkpoint}"
        )
    reader = FragmentReader(files)
    state: dict[str, torch.Tensor] = {}
    frozen = set(meta.get("frozen_fingerprints") or ())
    if frozen:
        warnings.warn(
            f"{folder} was saved without its {len(frozen)} frozen parameters (e.g. {min(frozen)!r}; "
            "exclude_frozen_parameters): the consolidated weights hold the trained parameters only; load them on top "
            "of the base model (save with exclude_frozen_parameters=False for a checkpoint of the whole model)",
            stacklevel=2,
        )
    for name, shape in shapes.items():
        if name in frozen:
            continue
        numel = int(torch.Size(shape).numel())
        saved_numel = reader.extent(name)
        if saved_numel is not None and saved_numel != numel:
            raise ValueError(
                f"{folder}/meta.json gives {name} the shape {shape} ({numel} elements) but the rank files hold "
                f"{saved_numel} elements of it: meta.json does not belong to these files"
            )
        values = _read(reader, name, numel)
        state[name] = values.reshape(shape).to(dtype if values.is_floating_point() else values.dtype)
    # Checkpoints written before non-persistent buffers were left out hold rotary `inv_freq` & co: drop them.
    persistent = set(skeleton.state_dict()) if skeleton is not None else None
    for key in reader.whole:
        if key.endswith("/buffer"):
            name = key[: -len("/buffer")]
            if persistent is not None and name not in persistent and any(n in persistent for n in shapes):
                continue
            tensor = reader.read_whole(key)
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def consolidate(checkpoint: str | Path, output_dir: str | Path, dtype: str = "fp32") -> Path:
    """Writes `output_dir` with the consolidated weights (`model.safetensors`, sharded with an index when large)
    plus the config and tokenizer files found next to the checkpoint.

    Returns:
        The output folder.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    state = consolidated_state_dict(checkpoint, DTYPES[dtype])
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    skeleton = _meta_model(Path(checkpoint))
    if skeleton is not None:
        skeleton.load_state_dict(state, assign=True, strict=False)
        skeleton.save_pretrained(out, state_dict=state)
    else:
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(state, out)
    # The user's own files win over the fresh ones save_pretrained writes (generation_config.json, config.json).
    for name in _COPIED:
        source = Path(checkpoint) / name
        if source.is_file():
            shutil.copy2(source, out / name)
    return out


def _check_shapes(saved: dict[str, list[int] | None], model: dict[str, list[int]], folder: Path) -> None:
    wrong = [
        f"{name}: checkpoint {shape}, config.json model {model[name]}"
        for name, shape in saved.items()
        if shape is not None and name in model and list(shape) != model[name]
    ]
    if wrong:
        raise ValueError(
            f"{folder}/meta.json and the config.json next to it disagree on {len(wrong)} parameter shapes: "
            + "; ".join(wrong[:10])
            + ". Put the config.json of the model that was trained next to the checkpoint."
        )


def _read(reader: FragmentReader, name: str, numel: int) -> torch.Tensor:
    whole = reader.read_whole(whole_key(name, "full"))
    if whole is not None:
        return whole.reshape(-1)
    for kind in ("master", "param"):
        found = reader.read_range(name, kind, 0, numel)
        if found is not None:
            return found
    raise ValueError(f"the checkpoint has no values for parameter {name!r}")


def _meta_model(checkpoint: Path) -> torch.nn.Module | None:
    """The model `config.json` describes, with meta tensors (no memory), or None without a config."""
    if not (checkpoint / "config.json").is_file():
        return None
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    architectures = getattr(config, "architectures", None) or []
    with torch.device("meta"):
        for architecture in architectures:
            import transformers

            cls = getattr(transformers, architecture, None)
            if cls is not None:
                return cls._from_config(config)
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            return AutoModel.from_config(config)
