"""The table of DeepSpeed's top-level keys (config/deepspeed_keys.py) against the installed DeepSpeed 0.19.8, and the
rule it applies ([Note: DeepSpeed's config rule]): off blocks load, on ones are refused naming the switch, strict
blocks keep their key check, keys DeepSpeed never reads are noted."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError
from accelerate_zero.config.compile_block import CompileConfig as OurCompileConfig
from accelerate_zero.config.deepspeed_keys import TOP_LEVEL, Treatment
from accelerate_zero.config.loading import ALIASES
from accelerate_zero.config.monitor_blocks import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)


def _deepspeed_config_module():  # noqa: ANN202
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    module = pytest.importorskip("deepspeed.runtime.config")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return module


def _keys_deepspeed_reads() -> set[str]:
    """Every top-level key `DeepSpeedConfig` looks up, recorded by a dict that notes each lookup."""
    module = _deepspeed_config_module()
    seen: set[str] = set()

    class Keys:
        def __init__(self, data: dict) -> None:
            self.data = data

        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return dict.__contains__(self.data, key)

        def __iter__(self):  # noqa: ANN204
            return iter(dict.keys(self.data))

    class Recording(dict):
        def get(self, key, *default):  # noqa: ANN001, ANN202
            seen.add(key)
            return dict.get(self, key, *default)

        def __getitem__(self, key):  # noqa: ANN001, ANN204
            seen.add(key)
            return dict.__getitem__(self, key)

        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return dict.__contains__(self, key)

        def keys(self):  # noqa: ANN202
            return Keys(self)

        def __copy__(self) -> Recording:
            return self

    module.DeepSpeedConfig(Recording({"train_batch_size": 1}))
    return seen


def test_the_table_has_every_top_level_key_deepspeed_reads() -> None:
    read = _keys_deepspeed_reads() - set(ALIASES[""])  # `bfloat16` is renamed to `bf16` before the table
    assert len(read) > 50
    assert read <= set(TOP_LEVEL), sorted(read - set(TOP_LEVEL))
    ours = {key for key, entry in TOP_LEVEL.items() if entry.treatment is Treatment.OURS}
    # DeepSpeed reads sequence_parallel_size in DeepSpeedConfig.__init__ under torch.distributed only
    assert set(TOP_LEVEL) - read - ours == {"sequence_parallel_size"}


def test_built_keys_are_the_config_fields() -> None:
    fields = {f.name for f in dataclasses.fields(ZeroConfig)}
    built = {key for key, entry in TOP_LEVEL.items() if entry.treatment in (Treatment.BUILT, Treatment.OURS)}
    assert built == fields


def test_removed_and_strict_blocks_are_deepspeeds() -> None:
    module = _deepspeed_config_module()
    removed = {key for key, entry in TOP_LEVEL.items() if entry.treatment is Treatment.REMOVED}
    assert removed == set(module._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

    # the compile block is built (config/compile_block.py): every key of DeepSpeed's, none more
    assert {f.name for f in dataclasses.fields(OurCompileConfig)} == set(CompileConfig.model_fields)
    models = {
        "hybrid_engine": module.HybridEngineConfig,
        "tensor_parallel": TPTrainingConfig,
        "weight_quantization": WeightQuantConfig,
    }
    for key, model in models.items():
        assert set(TOP_LEVEL[key].keys or ()) == set(model.model_fields), key


def test_monitor_blocks_have_deepspeeds_keys() -> None:
    _deepspeed_config_module()
    from deepspeed.comm.config import CommsLoggerConfig as TheirComms
    from deepspeed.monitor import config as theirs

    pairs = [
        (TensorBoardConfig, theirs.TensorBoardConfig),
        (WandbConfig, theirs.WandbConfig),
        (CSVMonitorConfig, theirs.CSVConfig),
        (CometConfig, theirs.CometConfig),
        (CommsLoggerConfig, TheirComms),
    ]
    for ours, their in pairs:
        assert {f.name for f in dataclasses.fields(ours)} == set(their.model_fields), ours.__name__


def _problems(raw: dict) -> list[str]:
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_any(raw)
    return info.value.problems


@pytest.mark.parametrize(
    ("off", "on", "switch"),
    [
        ({"hybrid_engine": {"enabled": False, "max_out_tokens": 512}}, {"hybrid_engine": {"enabled": True}},
         "hybrid_engine.enabled"),
        ({"tensor_parallel": {"autotp_size": 1}}, {"tensor_parallel": {"autotp_size": 2}},
         "tensor_parallel.autotp_size=2"),
        ({"torch_autocast": {"enabled": False, "dtype": "bfloat16"}}, {"torch_autocast": {"enabled": True}},
         "torch_autocast.enabled"),
        ({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": False}}},
         {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True}}},
         "data_efficiency.data_routing.enabled"),
        ({"amp": {"enabled": False}}, {"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
        ({"gradient_allreduce_op": "mean"}, {"gradient_allreduce_op": "sum"}, "gradient_allreduce_op='sum'"),
    ],
)  # fmt: skip
def test_a_feature_we_lack_loads_while_off_and_is_refused_by_name_when_on(off: dict, on: dict, switch: str) -> None:
    ZeroConfig.from_any(off)
    (problem,) = _problems(on)
    assert problem.startswith(f"{switch} turns on a feature accelerate_zero does not have (")


def test_the_compile_block_is_built_and_deepcompile_refused_by_name() -> None:
    assert (
        ZeroConfig.from_any({"compile": {"deepcompile": False, "offload_activation": False}}).compile.deepcompile
        is False
    )
    (problem,) = _problems({"compile": {"deepcompile": True}})
    assert problem.startswith(
        "compile.deepcompile=True is not supported (DeepCompile is not implemented; engine.compile()"
    )


def test_strict_blocks_keep_their_key_check_and_unread_keys_are_noted() -> None:
    assert _problems({"compile": {"deepcompil": False}}) == [
        "unknown key 'compile.deepcompil' (did you mean 'deepcompile'?): remove it or fix its spelling"
    ]
    notes = ZeroConfig.from_any(
        {"_comment": "x", "timers": {"throughput": {"enabled": True}}, "curriculum_learning": {"enabled": False}}
    ).notes
    assert notes == (
        "'_comment' is not a key DeepSpeed reads: accepted and ignored (DeepSpeed ignores it too)",
        "'timers' is accepted and has no effect: it switches DeepSpeed's throughput log; accelerate_zero's progress "
        "line is steps_per_print",
        "'curriculum_learning' is off, so it is accepted (the legacy curriculum learning (DeepSpeed's data_efficiency "
        "replaces it): DeepSpeed 0.19.8 removed it and refuses the key (deepspeedai/DeepSpeed#8489); here an off "
        "block is harmless)",
    )
    assert ZeroConfig.from_any({}).notes == ()
