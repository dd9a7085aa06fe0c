"""`accelerate-zero estimate --num_nodes N`: bytes per step inside and between nodes per stage-3 layout, the memory
each costs, and the recommended layout ([Note: the layout formulas] in debug/layouts.py; the engine's measured
bytes are checked against the same formulas in tests/distributed/test_layouts.py)."""

from __future__ import annotations

import pytest

from accelerate_zero.debug.layouts import all_to_all, gather, layout_rows, recommend_layout
from tests.unit.test_estimate import estimate_json, run_cli


GiB = 2**30


def test_volume_of_one_collective_by_hand() -> None:
    # 4 ranks on 2 nodes: each node holds half of the 8 bytes gathered and receives the other half once; inside,
    # each of its 2 ranks receives 6 bytes in all, 4 of which came across nodes once and are shared.
    assert gather(8, group=4, per_node=2).between == 4
    assert gather(8, group=4, per_node=2).inside == 2 * 8 * 3 / 4 - 4
    assert gather(8, group=2, per_node=2).between == 0  # inside one node
    # an all-to-all of 8 bytes per rank over 4 ranks on 2 nodes: each rank sends 2 bytes to each of 2 remote ranks
    assert all_to_all(8, group=4, per_node=2).between == 2 * 2 * 2


def test_the_formulas_of_each_layout_on_two_nodes() -> None:
    rows = {row.name: row for row in layout_rows(1000, 1000, 2, 4, num_nodes=2, per_node=8, states=16_000)}
    P, G = 2000, 4000  # bf16 parameters, fp32 gradients
    assert rows["flat"].traffic.between == pytest.approx((2 * P + G) / 2)
    assert rows["hpZ"].traffic.between == pytest.approx((P + G) / 2)
    assert rows["MiCS"].traffic.between == pytest.approx(2 * G / 2)
    # int8 weights with a 4-byte scale per 256, int4 gradients with one per 64
    assert rows["ZeRO++"].traffic.between == pytest.approx((1000 * (1 + 4 / 256) + 1000 * (0.5 + 4 / 64)) / 2)
    assert rows["MiCS"].model_states == 2 * 16_000 and rows["hpZ"].secondary_copy == P // 8
    assert not rows["ZeRO++"].exact


def test_recommendation_prefers_the_fewest_bytes_between_nodes_that_fit() -> None:
    rows = layout_rows(1000, 1000, 2, 2, num_nodes=2, per_node=8, states=16_000)  # MiCS and hpZ tie (P = G)
    assert recommend_layout(rows, room=None, num_nodes=2).name == "MiCS"  # a tie: its gathers stay in the node
    assert recommend_layout(rows, room=1000, num_nodes=2).name == "hpZ"  # MiCS's doubled states do not fit
    assert recommend_layout(rows, room=0, num_nodes=2).name == "flat"  # not even hpZ's secondary copy
    assert recommend_layout(rows, room=None, num_nodes=1).name == "flat"


def test_the_cli_prints_the_layouts_on_several_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    report = estimate_json(capsys, "--params", "8e9", "--num_gpus", "8", "--num_nodes", "2", "--gpu_memory", "80GB")
    layouts = report["layouts"]
    assert [row["layout"] for row in layouts["rows"]] == ["flat", "hpZ", "MiCS", "ZeRO++"]
    by_name = {row["layout"]: row for row in layouts["rows"]}
    # 8e9 bf16 parameters, fp32 gradients, 2 nodes: flat sends (2P + G)/2 = 32 GB per node and micro-step
    assert by_name["flat"]["between_nodes_per_micro_step"] == pytest.approx((2 * 16e9 + 32e9) / 2, rel=1e-6)
    assert layouts["recommended"] == "hpZ"
    assert by_name["hpZ"]["zero_optimization"] == {"zero_hpz_partition_size": 8}
    code, out, _ = run_cli(capsys, "--params", "8e9", "--num_gpus", "8", "--num_nodes", "2", "--gpu_memory", "80GB")
    assert code == 0 and 'layout recommendation: hpZ {"zero_hpz_partition_size": 8}' in out
    assert estimate_json(capsys, "--params", "8e9", "--num_gpus", "8")["layouts"] is None


def test_activations_per_rank_with_sequence_parallelism_and_tiling() -> None:
    from accelerate_zero.debug.estimate import Architecture, activation_bytes

    arch = Architecture(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=128_256)
    whole = activation_bytes(arch, micro_batch=1, seq_len=32768, compute_bytes=2)
    split = activation_bytes(arch, micro_batch=1, seq_len=32768, compute_bytes=2, sequence_parallel=4)
    tiled = activation_bytes(arch, micro_batch=1, seq_len=32768, compute_bytes=2, sequence_parallel=4, tile_tokens=512)
    assert split == pytest.approx(whole / 4, rel=1e-9)  # every term per token, each rank 1/4 of the tokens
    # the MLP's intermediates (15 of 34 s b h) and all but one tile of the logits go
    layers = 32 * 34 * (32768 // 4) * 4096
    logits = (32768 // 4) * 128_256 * 10
    assert tiled == layers * 19 // 34 + 512 * 128_256 * 10
    assert tiled * 2 < split and split == layers + logits
