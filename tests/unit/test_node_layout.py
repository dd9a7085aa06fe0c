"""The node layout from the launcher's environment, and the groups of each sharding layout (engine/nodes.py,
engine/layout.py), without a process group."""

from __future__ import annotations

import pytest

from accelerate_zero.config import ZeroConfig, ZeroConfigError, resolve_config
from accelerate_zero.engine.layout import LayoutPlan, plan_from_config
from accelerate_zero.engine.nodes import NodeLayout, node_layout_from_env


def test_node_layout_sources_in_order() -> None:
    env = {"ACCELERATE_ZERO_SIMULATED_NODES": "2", "LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "8"}
    assert node_layout_from_env(8, env).ranks_per_node == 4
    assert node_layout_from_env(16, {"LOCAL_WORLD_SIZE": "8"}).num_nodes == 2
    assert node_layout_from_env(16, {"SLURM_NTASKS_PER_NODE": "4(x4)"}).num_nodes == 4
    assert node_layout_from_env(4, {}).num_nodes == 1
    with pytest.raises(ValueError, match="ACCELERATE_ZERO_SIMULATED_NODES=3: 8 ranks cannot be split into 3"):
        node_layout_from_env(8, {"ACCELERATE_ZERO_SIMULATED_NODES": "3"})
    with pytest.raises(ValueError, match="every node must run the same number of ranks"):
        node_layout_from_env(6, {"LOCAL_WORLD_SIZE": "4"})


def test_groups_of_each_layout() -> None:
    nodes = NodeLayout(8, 4)
    mics = LayoutPlan(nodes, shard_size=4)
    assert mics.kind == "replicate_x_shard" and mics.num_replicas == 2
    assert mics.shard_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mics.replicate_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [mics.shard_index_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    hpz = LayoutPlan(nodes, shard_size=8, secondary_size=4, two_level=True)
    assert hpz.kind == "hpz" and hpz.secondary_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert hpz.across_node_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(ValueError, match="cannot be combined"):
        LayoutPlan(nodes, shard_size=4, secondary_size=2)


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        ({"stage": 2, "zero_hpz_partition_size": 4}, "zero_hpz_partition_size=4 needs zero_optimization.stage=3"),
        ({"stage": 3, "mics_shard_size": 3}, "mics_shard_size=3 does not divide the 8 data-parallel ranks"),
        ({"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 4}, "are both set"),
        ({"stage": 1, "zero_quantized_weights": True}, "zero_quantized_weights=true needs zero_optimization.stage=3"),
        ({"stage": 3, "mics_shard_size": 4, "zero_quantized_gradients": True}, "use zero_hpz_partition_size"),
        (
            {"stage": 3, "zero_quantized_weights": True, "stage3_use_all_reduce_for_fetch_params": True},
            "int8 weights travel in an all-gather",
        ),
    ],
)
def test_layout_keys_are_checked_before_training(zero: dict, message: str) -> None:
    with pytest.raises(ZeroConfigError, match=message):
        resolve_config(ZeroConfig.from_any({"zero_optimization": zero}), world_size=8)


def test_off_values_select_the_flat_layout() -> None:
    config = resolve_config(
        ZeroConfig.from_any({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0, "mics_shard_size": 0}}),
        world_size=8,
    )
    assert plan_from_config(config, NodeLayout(8, 4)).kind == "flat"


def test_sequence_parallel_size_divides_the_world_and_leaves_the_batch_rule_data_parallel_ranks() -> None:
    with pytest.raises(ZeroConfigError, match=r"sequence_parallel_size=3 does not divide the 8 ranks"):
        resolve_config(ZeroConfig.from_any({"sequence_parallel_size": 3}), world_size=8)
    config = {"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    resolved = resolve_config(ZeroConfig.from_any(config), world_size=8)
    assert resolved.train_batch_size == 2 * 1 * 4  # DeepSpeed: world size / sequence_parallel_size ranks of data
    plan = plan_from_config(resolved, NodeLayout(8, 8))
    assert plan.sequence_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
