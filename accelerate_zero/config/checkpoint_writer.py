"""DeepSpeed's `checkpoint.writer` block, read as far as accelerate_zero's checkpoint writer implements it.

[Note: DeepSpeed's checkpoint writer]
DeepSpeed 0.19 reads `"checkpoint": {"writer": {"type", "decoupled", "io_buffer_size", "io_buffer_double",
"show_statistics", "data_parallel", "io_multiplier"}}` (deepspeed/runtime/model_checkpointing/). With the block
present its engine saves through a `FastCheckpointEngine` (type "fast", the default: DeepNVMe buffered writes) or,
with `decoupled: true`, a `DecoupledCheckpointEngine`: `save_checkpoint` hands every state dict to a writer process
and returns; the checkpoint is committed (`latest` written) later, once that process has written it. That is what
our asynchronous saves do ([Note: asynchronous saves] in checkpoint/async_save.py): `decoupled: true` means `async_save=True`
wherever the config as written is at hand (the Trainer, `ZeroAccelerator.save_state`). One difference, on the safe
side: DeepSpeed commits at the next optimizer step; we publish as soon as every rank's writer is done and wait for
the writer at the next save or load (either way `latest` names the previous checkpoint until then).

`type` "fast" and "python" both mean "write the files" (the files and their checksums are the same whichever
writer is used), so both are accepted; "mock" writes nothing and is refused. The other keys tune DeepSpeed's own
writer (DeepNVMe buffer sizes, statistics printing, which data-parallel ranks write replicated state: every rank
writes its own shard here), which accelerate_zero does not have: they are refused by name rather than accepted and
ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


WRITER_PATH = "checkpoint.writer"
_TYPES = ("fast", "python")
_REFUSED = {
    "io_buffer_size": "it sizes DeepSpeed's DeepNVMe write buffer; accelerate_zero writes through Python file I/O",
    "io_buffer_double": "it double-buffers DeepSpeed's DeepNVMe writes; accelerate_zero writes through Python file I/O",
    "io_multiplier": "it scales DeepSpeed's DeepNVMe writes; accelerate_zero writes through Python file I/O",
    "show_statistics": "it prints DeepSpeed's writer statistics; accelerate_zero's writer keeps none",
    "data_parallel": "it picks which data-parallel ranks write replicated state; every rank writes its own shard here",
}


def writer_problems(writer: Any) -> list[str]:
    """What is wrong with a `checkpoint.writer` value as written (empty: accepted); each problem names the key and
    the fix."""
    if writer is None:
        return []
    if not isinstance(writer, Mapping):
        return [f"{WRITER_PATH}={writer!r}: expected a mapping such as {{'decoupled': true}}"]
    problems = []
    for key, value in writer.items():
        path = f"{WRITER_PATH}.{key}"
        if key == "decoupled":
            if not isinstance(value, bool):
                problems.append(f"{path}={value!r}: expected true or false")
        elif key == "type":
            if not isinstance(value, str) or value.lower() not in (*_TYPES, "mock"):
                problems.append(f"{path}={value!r}: expected one of {list(_TYPES)} (case-insensitive)")
            elif value.lower() == "mock":
                problems.append(f"{path}='mock': DeepSpeed's mock writer saves nothing; use 'python' or 'fast'")
        elif key in _REFUSED:
            problems.append(f"unknown key '{path}': {_REFUSED[key]}; remove it")
        else:
            problems.append(f"unknown key '{path}': the keys are 'decoupled' and 'type'; remove it")
    return problems


def writer_decoupled(writer: Mapping[str, Any] | None) -> bool:
    """Whether a `checkpoint.writer` block asks for asynchronous saves (`decoupled: true`)."""
    return isinstance(writer, Mapping) and writer.get("decoupled") is True


def decoupled(deepspeed_config: Mapping[str, Any] | None) -> bool:
    """Whether a DeepSpeed config as written asks for asynchronous saves (`checkpoint.writer.decoupled: true`)."""
    checkpoint = (deepspeed_config or {}).get("checkpoint")
    writer = checkpoint.get("writer") if isinstance(checkpoint, Mapping) else None
    return isinstance(writer, Mapping) and writer.get("decoupled") is True
