"""accelerate's ParallelismConfig mapped onto the engine's layout (integrations/accelerate/parallelism.py)."""

from __future__ import annotations

import pytest
from accelerate import ParallelismConfig

from accelerate_zero.config import ZeroConfig
from accelerate_zero.integrations.accelerate.parallelism import with_zero_keys, zero_keys_from_parallelism


def test_replicate_x_shard_is_mics_and_plain_sharding_is_flat() -> None:
    assert zero_keys_from_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=4), 8) == {
        "zero_optimization": {"mics_shard_size": 4}
    }
    assert zero_keys_from_parallelism(ParallelismConfig(dp_shard_size=8), 8) == {}
    assert zero_keys_from_parallelism(None, 8) == {}


def test_other_dimensions_and_wrong_products_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"ParallelismConfig\(tp_size=2\)"):
        zero_keys_from_parallelism(ParallelismConfig(dp_shard_size=4, tp_size=2), 8)
    with pytest.raises(ValueError, match=r"processes / sp_size = 8 .*dp_replicate_size x dp_shard_size = 6 contra"):
        zero_keys_from_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=3), 8)


SP2 = {"sp_backend": "deepspeed", "sp_size": 2}


@pytest.mark.parametrize(
    ("sizes", "world_size", "expected"),
    [
        # [Note: data parallelism derived from the processes]: accelerate fills every size left out with 1
        ({}, 2, {}),
        ({}, 3, {}),
        ({}, 4, {}),
        (SP2, 2, {"sequence_parallel_size": 2}),
        (SP2, 4, {"sequence_parallel_size": 2}),
        ({**SP2, "dp_shard_size": 1}, 4, {"sequence_parallel_size": 2}),  # an ALST YAML's `dp_shard_size: 1`
        ({**SP2, "dp_shard_size": 2}, 4, {"sequence_parallel_size": 2}),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, {"zero_optimization": {"mics_shard_size": 2}}),
        ({"dp_replicate_size": 2}, 4, {"zero_optimization": {"mics_shard_size": 2}}),  # dp_shard_size derived
        ({"dp_replicate_size": 3}, 3, {"zero_optimization": {"mics_shard_size": 1}}),  # replicated only
        ({"dp_shard_size": 3}, 3, {}),
        (SP2, 3, r"ParallelismConfig\(sp_size=2\) on 3 processes.*use an sp_size among \[1, 3\]"),
        (
            {**SP2, "dp_shard_size": 4},
            4,
            r"dp_shard_size=4, sp_size=2\) on 4 processes: data parallelism is processes "
            r"/ sp_size = 2 .*remove dp_shard_size \(it is derived: 2\) or set it to 2",
        ),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 2, r"= 4 contradicts it; remove dp_shard_size"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 3, r"set dp_replicate_size to a divisor of 3"),
    ],
)
def test_every_spelling_at_2_3_and_4_processes(
    sizes: dict, world_size: int, expected: dict | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's spellings (`ParallelismConfig()`, `sp_backend="deepspeed", sp_size=p`, `dp_replicate_size=R,
    dp_shard_size=S`) work wherever the sizes fit, data parallelism derived as processes / sp_size (DeepSpeed ALST's
    rule); a size that contradicts it is refused naming the value and the fix."""
    for name in ("DP_REPLICATE_SIZE", "DP_SHARD_SIZE", "SP_SIZE", "SP_BACKEND", "TP_SIZE", "CP_SIZE"):
        monkeypatch.delenv(f"PARALLELISM_CONFIG_{name}", raising=False)
    parallelism = ParallelismConfig(**sizes)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            zero_keys_from_parallelism(parallelism, world_size)
    else:
        assert zero_keys_from_parallelism(parallelism, world_size) == expected


def test_an_indivisible_sequence_size_is_the_one_error(tmp_path) -> None:
    """At 3 ranks with sp 2, the batch size the Trainer fills ("auto") agrees with the batch rule: the one error
    names sequence_parallel_size, not train_batch_size."""
    from types import SimpleNamespace

    from accelerate_zero.config import ZeroConfigError, resolve_config
    from accelerate_zero.integrations.transformers.auto_values import fill_from_training_args

    args = SimpleNamespace(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        world_size=3,
        parallelism_config=SimpleNamespace(sp_size=2),
        max_grad_norm=1.0,
        learning_rate=1e-3,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        save_on_each_node=False,
        fp16=False,
        fp16_full_eval=False,
        bf16=False,
        bf16_full_eval=False,
    )
    fill = fill_from_training_args({"train_batch_size": "auto", "zero_optimization": {"stage": 3}}, args)
    with pytest.raises(ZeroConfigError) as error:  # the size ParallelismConfig asks for, as the ranks write it
        resolve_config(ZeroConfig.from_any({**fill.config, "sequence_parallel_size": 2}), world_size=3)
    assert error.value.problems == ["sequence_parallel_size=2 does not divide the 3 ranks: use one of [1, 3]"]


def test_the_keys_join_the_config_unless_it_says_otherwise() -> None:
    config = ZeroConfig.from_any({"zero_optimization": {"stage": 3}})
    keys = {"zero_optimization": {"mics_shard_size": 4}}
    assert with_zero_keys(config, keys, "ParallelismConfig").zero_optimization.mics_shard_size == 4
    same = ZeroConfig.from_any({"zero_optimization": {"stage": 3, "mics_shard_size": 4}})
    assert with_zero_keys(same, keys, "ParallelismConfig").zero_optimization.mics_shard_size == 4
    other = ZeroConfig.from_any({"zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    with pytest.raises(ValueError, match=r"zero_optimization.mics_shard_size=2 vs ParallelismConfig 4"):
        with_zero_keys(other, keys, "ParallelismConfig")


def test_sequence_parallel_size_from_accelerate() -> None:
    sp = ParallelismConfig(dp_shard_size=2, sp_size=4, sp_backend="deepspeed")
    assert zero_keys_from_parallelism(sp, 8) == {"sequence_parallel_size": 4}
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=1, sp_size=2)
    assert zero_keys_from_parallelism(hsdp, 4) == {
        "sequence_parallel_size": 2,
        "zero_optimization": {"mics_shard_size": 2},
    }
    config = with_zero_keys(ZeroConfig.from_any({}), {"sequence_parallel_size": 4}, "ParallelismConfig")
    assert config.sequence_parallel_size == 4
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 vs ParallelismConfig 4"):
        with_zero_keys(
            ZeroConfig.from_any({"sequence_parallel_size": 2}), {"sequence_parallel_size": 4}, "ParallelismConfig"
        )


def test_sequence_handler_is_read_not_dropped() -> None:
    """accelerate's `sp_handler`: a fixed `sp_seq_length` reaches the loader; an attention other than SDPA is refused
    by name (ours runs SDPA over the whole sequence)."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from accelerate_zero.integrations.accelerate.sequence_parallel import sequence_handler_settings

    def settings(**handler: object) -> dict:
        handler_config = DeepSpeedSequenceParallelConfig(**handler)
        return sequence_handler_settings(ParallelismConfig(sp_size=2, sp_handler=handler_config))

    assert settings() == {"seq_length": None}
    assert settings(sp_seq_length=512, sp_seq_length_is_variable=False) == {"seq_length": 512}
    assert settings(sp_seq_length=512, sp_seq_length_is_variable=True) == {"seq_length": None}
    assert settings(sp_attn_implementation="sdpa") == {"seq_length": None}
    with pytest.raises(ValueError, match=r"sp_attn_implementation='flash_attention_2'.*set it to 'sdpa'"):
        settings(sp_attn_implementation="flash_attention_2")


def test_an_accelerate_launch_with_a_parallelism_block_is_adopted(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """[Note: adopting accelerate's parallelism launch]: `TrainingArguments` takes the sizes the launch exported and
    switches accelerate's own reading off, so the Trainer's accelerators neither refuse them nor drop them."""
    import os

    from accelerate_zero import TrainingArguments
    from accelerate_zero.integrations.accelerate import parallelism

    monkeypatch.setenv(parallelism.USE_PARALLELISM_ENV, "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.delenv(parallelism.ADOPTED_PARALLELISM_ENV, raising=False)
    args = TrainingArguments(output_dir=str(tmp_path), zero_config={"zero_optimization": {"stage": 3}}, report_to=[])
    assert args.parallelism_config.sp_size == 2
    assert os.environ[parallelism.USE_PARALLELISM_ENV] == "false", "accelerate must not build its own from it"
    assert parallelism.parallelism_from_launch().sp_size == 2, "the process's later accelerators get it too"
    monkeypatch.setenv(parallelism.ADOPTED_PARALLELISM_ENV, "false")
    assert parallelism.parallelism_from_launch() is None
