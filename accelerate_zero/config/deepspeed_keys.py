"""The one rule for DeepSpeed configs, and the table of DeepSpeed 0.19.8's top-level keys it is applied with.

[Note: DeepSpeed's config rule]
What DeepSpeed 0.19.8 accepts, accelerate_zero accepts with the same meaning; what it lacks is refused by name only
when a config turns it on. Concretely, for every key of a config:

* a block accelerate_zero builds (a `ZeroConfig` field) is validated by its dataclass; inside it an unknown key is
  an error with the closest valid key when DeepSpeed validates that block with a pydantic model (`KeyPolicy` in
  config/blocks.py: `fp16`, `bf16`, `zero_optimization`, the monitors), and a note when DeepSpeed reads the block
  key by key and never looks at the others (`optimizer`, `checkpoint`, `aio`, `activation_checkpointing`, ...);
* a DeepSpeed feature accelerate_zero does not have (`hybrid_engine`, `tensor_parallel`, `torch_autocast`, ...) is
  accepted while it is off (`"enabled": false`, `autotp_size` 0 or 1: DeepSpeed-Chat and OpenRLHF write them so)
  and refused when it is on, naming the switch and the reason; a block DeepSpeed validates strictly keeps its key
  check (a misspelled key stays an error, as in DeepSpeed);
* a block DeepSpeed 0.19.8 removed (and refuses whenever the key is present) is accepted while off, with a note,
  and refused when on, with DeepSpeed's reason;
* a key DeepSpeed reads but which changes nothing about training here (its own loggers, `vocabulary_size`'s
  warning) is accepted and named in a note that says why;
* any other key is one DeepSpeed never reads (`comms_config`, `monitor_config`, `_comment`): accepted and named in
  a note, "DeepSpeed ignores it too", with the closest key DeepSpeed knows when one is close;
* `"auto"` is a value wherever DeepSpeed's integrations fill one; an "auto" nothing filled takes the default in a
  block DeepSpeed validates with a pydantic model (DeepSpeed drops it there: `resolve_config`) and is an error
  elsewhere (DeepSpeed would use the string itself).

`TOP_LEVEL` lists every top-level key DeepSpeed 0.19.8 reads (tests/unit/test_deepspeed_rule.py checks it against
the installed DeepSpeed) with what accelerate_zero does with it; `top_level_problems` applies it. Notes are data
(`ZeroConfig.notes`), shown by `accelerate-zero validate` and logged once per process by `report_notes`.
"""

from __future__ import annotations

import difflib
import enum
import importlib.util
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


logger = logging.getLogger("accelerate_zero")

NOTED_ENV = "ACCELERATE_ZERO_CONFIG_NOTED"
"""Set by `accelerate-zero launch` in the ranks' environment once it has shown the notes: the ranks stay quiet."""

DEEPSPEED_IGNORES = "DeepSpeed ignores it too"


class Treatment(enum.Enum):
    """What accelerate_zero does with a top-level key of a DeepSpeed config."""

    BUILT = "built"
    """A `ZeroConfig` field: validated and implemented (or refused value by value, `schema.REFUSED_FEATURES`)."""
    OFF_ONLY = "off only"
    """A DeepSpeed feature accelerate_zero does not have: accepted while off, refused by name when on."""
    REMOVED = "removed"
    """Removed from DeepSpeed 0.19.8, which refuses the key: accepted while off (a note), refused when on."""
    INERT = "inert"
    """Read by DeepSpeed for its own logs or warnings only: accepted, named in a note saying why."""
    OURS = "ours"
    """Not a DeepSpeed key: accelerate_zero's own (`sequence_tiling`)."""


@dataclass(frozen=True)
class DeepSpeedKey:
    """One top-level key of a DeepSpeed config and what accelerate_zero does with it."""

    treatment: Treatment
    reason: str = ""
    """OFF_ONLY / REMOVED: why it is refused when on (and what to do); INERT: why it changes nothing here."""
    on: Callable[[Any], list[str]] | None = None
    """OFF_ONLY / REMOVED: the switches that are on in the value (e.g. ["hybrid_engine.enabled"]); [] when off."""
    keys: tuple[str, ...] | None = None
    """OFF_ONLY blocks DeepSpeed validates with a pydantic model: their keys (any other is an error, as there)."""


def _true(value: Any) -> bool:
    """True as DeepSpeed's pydantic models and `get_scalar_param` read a switch ("auto" dropped: off)."""
    return value is True or (isinstance(value, str) and value.lower() == "true") or (type(value) is int and value == 1)


def _enabled(name: str) -> Callable[[Any], list[str]]:
    return lambda block: [f"{name}.enabled"] if isinstance(block, Mapping) and _true(block.get("enabled")) else []


def _switch(name: str, default: Any) -> Callable[[Any], list[str]]:
    """A scalar that is on whenever it differs from DeepSpeed's default."""
    return lambda value: [] if value == default or value is None else [f"{name}={value!r}"]


def _tensor_parallel_on(block: Any) -> list[str]:
    size = block.get("autotp_size", 0) if isinstance(block, Mapping) else 0
    return [f"tensor_parallel.autotp_size={size!r}"] if isinstance(size, int) and size > 1 else []


def _data_efficiency_on(block: Any) -> list[str]:
    """On when it is enabled and one of its two features is: `enabled` alone changes nothing in DeepSpeed."""
    if not isinstance(block, Mapping) or not _true(block.get("enabled")):
        return []
    return [
        f"data_efficiency.{part}.enabled"
        for part in ("data_sampling", "data_routing")
        if isinstance(block.get(part), Mapping) and _true(block[part].get("enabled"))
    ]


def _weight_quantization_on(block: Any) -> list[str]:
    if not isinstance(block, Mapping):
        return []
    parts = ("quantized_initialization", "post_init_quant")
    return [f"weight_quantization.{part}" for part in parts if block.get(part)]


def _datastates_on(value: Any) -> list[str]:
    return [] if value is None or value is False else ["datastates_ckpt"]


_NOT_HERE = "accelerate_zero does not have it"
_REMOVED = "DeepSpeed 0.19.8 removed it and refuses the key (deepspeedai/DeepSpeed#8489)"

TOP_LEVEL: dict[str, DeepSpeedKey] = {
    **{
        key: DeepSpeedKey(Treatment.BUILT)
        for key in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "fp16",
            "bf16",
            "optimizer",
            "scheduler",
            "zero_optimization",
            "sequence_parallel_size",
            "seq_parallel_communication_data_type",
            "steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "communication_data_type",
            "prescale_gradients",
            "gradient_predivide_factor",
            "data_types",
            "checkpoint",
            "dataloader_drop_last",
            "aio",
            "activation_checkpointing",
            "expert_parallel",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "comms_logger",
            "flops_profiler",
            "compile",
        )
    },  # fmt: skip
    "sequence_tiling": DeepSpeedKey(Treatment.OURS),
    "hybrid_engine": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "DeepSpeed's Hybrid Engine (inference kernels inside RLHF training) is not built; generate() runs on the "
        "training engine (ZeRO-3 gathers the layers it runs)",
        _enabled("hybrid_engine"),
        (
            "enabled",
            "max_out_tokens",
            "inference_tp_size",
            "release_inference_cache",
            "pin_parameters",
            "tp_gather_partition_size",
            "enable_cuda_graph",
        ),
    ),  # fmt: skip
    "tensor_parallel": DeepSpeedKey(
        Treatment.OFF_ONLY,
        f"AutoTP tensor parallelism: {_NOT_HERE}; shard with ZeRO stage 3 instead (autotp_size 0 or 1 is off)",
        _tensor_parallel_on,
        (
            "dtype",
            "autotp_size",
            "tp_overlap_comm",
            "vocab_parallel_lm_head",
            "vocab_parallel_ce_backend",
            "tensor_parallel",
            "injection_policy_tuple",
            "partition_config",
            "preset_model",
            "keep_module_on_host",
            "replace_with_kernel_inject",
        ),
    ),  # fmt: skip
    "weight_quantization": DeepSpeedKey(
        Treatment.OFF_ONLY,
        f"quantized weights at initialization or after it (ZeRO-Init, Hybrid Engine): {_NOT_HERE}",
        _weight_quantization_on,
        ("enabled", "num_bits", "q_type", "q_groups", "quantized_initialization", "post_init_quant"),
    ),
    "torch_autocast": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "DeepSpeed's torch_autocast keeps fp32 parameters, runs forward under torch.autocast and reduces the "
        "gradients of lower_precision_safe_modules in the low dtype; accelerate_zero's mixed precision is the bf16 / "
        "fp16 block (16-bit parameters, fp32 masters, fp32 gradient accumulation): set bf16.enabled (or "
        "fp16.enabled) for the same compute dtype in less memory, or keep fp32 training and call the model inside "
        "torch.autocast yourself",
        _enabled("torch_autocast"),
    ),
    "data_efficiency": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "DeepSpeed's data efficiency library (curriculum data sampling, random-LTD) drives DeepSpeed's own "
        f"dataloader and layer dropping: {_NOT_HERE}",
        _data_efficiency_on,
    ),
    "autotuning": DeepSpeedKey(
        Treatment.OFF_ONLY,
        f"the autotuner runs through DeepSpeed's launcher: {_NOT_HERE} (accelerate-zero estimate sizes a config)",
        _enabled("autotuning"),
    ),
    "datastates_ckpt": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "DataStates asynchronous checkpointing: use checkpoint.writer.decoupled (accelerate_zero's asynchronous save)",
        _datastates_on,
    ),
    "dump_state": DeepSpeedKey(
        Treatment.OFF_ONLY, "it prints DeepSpeed's engine state at start: " + _NOT_HERE, _switch("dump_state", False)
    ),
    "disable_allgather": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "DeepSpeed's broadcast-based parameter update below ZeRO: " + _NOT_HERE,
        _switch("disable_allgather", False),
    ),
    "gradient_allreduce_op": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "gradients are averaged over the data-parallel ranks; summing them is not built",
        _switch("gradient_allreduce_op", "mean"),
    ),
    "managed_gradient_accumulation": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "every step() is an accumulation boundary in DeepSpeed's unmanaged mode; here the boundary is counted "
        "(gradient_accumulation_steps) or set with engine.set_gradient_accumulation_boundary()",
        _switch("managed_gradient_accumulation", True),
    ),
    "disable_python_gc": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "it runs Python's garbage collector on DeepSpeed's own schedule: " + _NOT_HERE,
        _switch("disable_python_gc", False),
    ),
    "use_data_before_expert_parallelism": DeepSpeedKey(
        Treatment.OFF_ONLY,
        "the data-parallel ranks come before the expert-parallel ones here (expert_parallel.autoep_size groups "
        "consecutive ranks)",
        _switch("use_data_before_expert_parallelism", False),
    ),
    "pipeline": DeepSpeedKey(
        Treatment.INERT,
        "it configures DeepSpeed's PipelineModule engine, which DeepSpeed only builds for a PipelineModule; "
        "accelerate_zero trains no PipelineModule",
    ),
    "timers": DeepSpeedKey(
        Treatment.INERT, "it switches DeepSpeed's throughput log; accelerate_zero's progress line is steps_per_print"
    ),
    "log_level": DeepSpeedKey(
        Treatment.INERT, "it sets DeepSpeed's logger; set logging.getLogger('accelerate_zero') instead"
    ),
    "vocabulary_size": DeepSpeedKey(
        Treatment.INERT, "DeepSpeed only warns when it is not a multiple of 8; it changes no computation"
    ),
    **{
        key: DeepSpeedKey(
            Treatment.REMOVED,
            f"{what}: {_REMOVED}",
            _switch(key, False) if key == "sparse_gradients" else _enabled(key),  # a flag there, not a block
        )
        for key, what in {
            "nebula": "Nebula checkpointing",
            "compression_training": "DeepSpeed's compression library",
            "amp": "NVIDIA Apex AMP (use bf16 or fp16)",
            "quantize_training": "Mixture-of-Quantization",
            "sparse_gradients": "sparse embedding gradients",
            "eigenvalue": "eigenvalue-based MoQ",
            "sparse_attention": "DeepSpeed Sparse Attention",
            "elasticity": "elastic training",
            "graph_harvesting": "graph harvesting",
            "curriculum_learning": "the legacy curriculum learning (DeepSpeed's data_efficiency replaces it)",
            "progressive_layer_drop": "progressive layer dropping",
        }.items()
    },
}
"""Every top-level key DeepSpeed 0.19.8 reads (and ours), with what accelerate_zero does with it. To build one of
the OFF_ONLY features, add its block to `ZeroConfig` and mark it BUILT here."""


def top_level_problems(raw: Mapping[str, Any], built: Collection[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Applies the rule ([Note: DeepSpeed's config rule]) to the top-level keys of a raw config.

    Args:
        raw: the config as written (aliases already renamed).
        built: the keys `ZeroConfig` has fields for.

    Returns:
        (the keys `ZeroConfig` builds, with their values; the problems; the notes).
    """
    kept: dict[str, Any] = {}
    problems: list[str] = []
    notes: list[str] = []
    for key, value in raw.items():
        entry = TOP_LEVEL.get(key) if isinstance(key, str) else None
        if key in built:
            kept[key] = value
        elif entry is None:
            notes.append(unread_key_note(str(key), [*TOP_LEVEL]))
        elif entry.treatment is Treatment.INERT:
            notes.append(f"'{key}' is accepted and has no effect: {entry.reason}")
        else:
            refused = _off_only_problems(key, value, entry)
            problems.extend(refused)
            if entry.treatment is Treatment.REMOVED and not refused:
                notes.append(f"'{key}' is off, so it is accepted ({entry.reason}; here an off block is harmless)")
    return kept, problems, notes


def _off_only_problems(key: str, value: Any, entry: DeepSpeedKey) -> list[str]:
    problems = []
    if entry.keys is not None:
        if not isinstance(value, Mapping):
            return [f"{key}={value!r}: expected a mapping of keys to values"]
        problems += [unknown_key_problem(key, str(k), entry.keys) for k in value if k not in entry.keys]
    assert entry.on is not None
    problems += [
        f"{switch} turns on a feature accelerate_zero does not have ({entry.reason}): remove '{key}' or switch it off"
        for switch in entry.on(value)
    ]
    return problems


def unknown_key_problem(path: str, key: str, valid: Iterable[str]) -> str:
    """The error for a key a strictly validated block does not have, with the closest valid key."""
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    full = f"{path}.{key}" if path else key
    return f"unknown key '{full}'{hint}: remove it or fix its spelling"


def unread_key_note(full: str, valid: Iterable[str]) -> str:
    """The note for a key DeepSpeed never reads, with the closest key it knows (a typo would be ignored there too)."""
    leaf = full.rsplit(".", 1)[-1]
    # "_comment" and the like are comments: no suggestion
    close = [] if leaf.startswith("_") else difflib.get_close_matches(leaf, sorted(valid), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"'{full}' is not a key DeepSpeed reads: accepted and ignored ({DEEPSPEED_IGNORES}{hint})"


def library_problems(enabled: Mapping[str, str]) -> list[str]:
    """Monitors that are on without their library: {"wandb": "wandb", "comet": "comet_ml"} -> problems."""
    return [
        f"{block}.enabled=true needs the '{module}' package, which is not installed: pip install "
        f"{module.replace('_', '-')} (or switch {block} off)"
        for block, module in enabled.items()
        if importlib.util.find_spec(module) is None
    ]


_REPORTED: set[str] = set()


def report_notes(notes: Iterable[str]) -> None:
    """Logs each note once per process, on the first process only (no RANK, or RANK 0), and not in the ranks of
    `accelerate-zero launch`, which showed them before starting them."""
    if os.environ.get(NOTED_ENV) or os.environ.get("RANK", "0") != "0":
        return
    for note in notes:
        if note not in _REPORTED:
            _REPORTED.add(note)
            logger.warning("accelerate_zero config note: %s", note)
