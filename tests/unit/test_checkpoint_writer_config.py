"""DeepSpeed's `checkpoint.writer` block ([Note: DeepSpeed's checkpoint writer] in
accelerate_zero/config/checkpoint_writer.py): `decoupled` and `type` are read, every other key is refused by name
with the reason, and `decoupled: true` makes `ZeroAccelerator.save_state` save asynchronously unless the call says
otherwise. The Trainer's use of it is tests/integration/test_trainer_checkpoint_async.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accelerate_zero import ZeroConfig
from accelerate_zero.config.checkpoint_writer import decoupled
from accelerate_zero.config.values import ZeroConfigError
from accelerate_zero.integrations.accelerate.checkpointing import engine_save_kwargs
from accelerate_zero.integrations.accelerate.plugin import ZeroPlugin


def _config(writer: object) -> dict:
    return {"zero_optimization": {"stage": 2}, "checkpoint": {"writer": writer}}


@pytest.mark.parametrize("writer", [{"decoupled": True}, {"decoupled": False, "type": "FAST"}, {"type": "python"}])
def test_decoupled_and_type_are_accepted(writer: dict) -> None:
    ZeroConfig.from_any(_config(writer))
    assert decoupled(_config(writer)) is writer.get("decoupled", False)


@pytest.mark.parametrize(
    ("writer", "expected"),
    [
        ({"type": "mock"}, "checkpoint.writer.type='mock': DeepSpeed's mock writer saves nothing"),
        ({"type": "nvme"}, "checkpoint.writer.type='nvme': expected one of ['fast', 'python']"),
        ({"decoupled": "yes"}, "checkpoint.writer.decoupled='yes': expected true or false"),
        ({"io_buffer_size": 64e6}, "'checkpoint.writer.io_buffer_size': it sizes DeepSpeed's DeepNVMe write buffer"),
        ({"io_buffer_double": True}, "'checkpoint.writer.io_buffer_double'"),
        ({"io_multiplier": 2}, "'checkpoint.writer.io_multiplier'"),
        ({"show_statistics": True}, "'checkpoint.writer.show_statistics'"),
        ({"data_parallel": "socket"}, "every rank writes its own shard here"),
        ({"decoupld": True}, "unknown key 'checkpoint.writer.decoupld': the keys are 'decoupled' and 'type'"),
        (True, "checkpoint.writer=True: expected a mapping"),
    ],
)
def test_other_keys_are_refused_by_name(writer: object, expected: str) -> None:
    with pytest.raises(ZeroConfigError) as error:
        ZeroConfig.from_any(_config(writer))
    assert expected in str(error.value)


def test_save_state_is_asynchronous_when_the_config_is_decoupled() -> None:
    plugin = ZeroPlugin(config=_config({"decoupled": True}))
    assert engine_save_kwargs(plugin, {}) == {"async_save": True}
    assert engine_save_kwargs(plugin, {"async_save": False}) == {"async_save": False}  # the call wins
    assert engine_save_kwargs(ZeroPlugin(config=_config({"type": "fast"})), {}) == {}


def test_engine_save_checkpoint_reads_decoupled_from_its_config(tmp_path: Any) -> None:
    """`initialize(config=...)` users get the key too: `save_checkpoint()` without `async_save` follows it (never an
    accepted key that does nothing); the call wins; a DCP save stays synchronous."""
    from unittest import mock

    import accelerate_zero

    calls = []

    def record(engine: Any, save_dir: Any, tag: Any, client: Any, exclude: Any, async_save: bool, fmt: str) -> str:
        calls.append((async_save, fmt))
        return str(save_dir)

    for writer, expected in (({"decoupled": True}, True), ({"type": "fast"}, False)):
        model = torch.nn.Linear(4, 2)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, **_config(writer)}
        engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        with mock.patch("accelerate_zero.engine.engine.save_engine", record):
            engine.save_checkpoint(str(tmp_path))
            engine.save_checkpoint(str(tmp_path), async_save=False)
            engine.save_checkpoint(str(tmp_path), checkpoint_format="dcp")
        engine.destroy()
        assert calls == [(expected, "universal"), (False, "universal"), (False, "dcp")], (writer, calls)
        calls.clear()
