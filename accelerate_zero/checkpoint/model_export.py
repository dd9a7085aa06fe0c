"""Telling a model export (`save_pretrained`: config.json and weight files) from a training checkpoint, so that a load
given one says what it is and what to do instead of "no 'latest' file" or "its save did not finish"."""

from __future__ import annotations

from pathlib import Path


_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


def export_files(folder: Path) -> list[str]:
    """The weight files of a Hugging Face `save_pretrained` folder (with its config.json / adapter_config.json), or
    [] when `folder` is not one."""
    if not ((folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()):
        return []
    return [name for name in _WEIGHTS if (folder / name).is_file()]


def not_a_checkpoint(folder: Path, files: list[str]) -> str:
    """The message for a model export given where a training checkpoint was expected."""
    adapter = any(name.startswith("adapter_model") for name in files)
    load = (
        f"PeftModel.from_pretrained(base_model, {str(folder)!r})"
        if adapter
        else f"AutoModelForCausalLM.from_pretrained({str(folder)!r})"
    )
    return (
        f"{folder} is a model export ({', '.join(files)}: weights only, written by save_pretrained/save_model), not a "
        f"training checkpoint: it holds no optimizer state, step or schedule to resume. Load the weights with "
        f"{load} and start a new run from them, or resume from a checkpoint folder (save_checkpoint, save_state, a "
        "Trainer's checkpoint-N)"
    )
