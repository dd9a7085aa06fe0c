"""`accelerate-zero estimate --expert_parallel EP`: the experts held 1/ep per rank and their states partitioned over
the peers ([Note: what expert parallelism holds, per rank] in debug/estimate_experts.py), the refusals, and the JSON.

What the engine really holds is compared in tests/distributed/test_estimate_experts_vs_engine.py; here the numbers
are checked against the arithmetic of the Note on shapes chosen so that no padding appears.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accelerate_zero.config import ZeroConfig
from accelerate_zero.debug import estimate as est
from accelerate_zero.debug import estimate_experts as ee
from tests.unit.test_estimate import TINY_LLAMA, estimate_json, run_cli, write_config


# 4 layers of 8 experts: gate_up [8, 2*16, 32] + down [8, 32, 16] = 8 * 1536 elements per layer.
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
EXPERTS = 4 * 8 * (2 * 16 * 32 + 32 * 16)


def _meta_model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in QWEN3_MOE.items() if k != "architectures"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_experts_are_held_one_ep_th_and_their_states_one_wth(ep: int, stage: int) -> None:
    world = 8
    shapes = ee.expert_shapes_from_module(_meta_model(), ep)
    assert shapes.expert_numel == EXPERTS and shapes.local_numel == EXPERTS // ep
    assert shapes.rest.numel + EXPERTS == sum(p.numel() for p in _meta_model().parameters())
    for precision, c in (("no", 4), ("bf16", 2)):
        setup = est.TrainingSetup(world, precision, "adamw")
        got = ee.expert_bytes_per_rank(shapes, setup, stage)
        # whole experts, 1/ep of them, in the compute dtype, at every stage
        assert got["parameters"] == EXPERTS // ep * c
        # fp32 gradients: the local experts whole at stage 1, their 1/(W/ep) over the peers at stages 2-3 = 1/W
        assert got["gradients"] == (EXPERTS // ep * 4 if stage == 1 else EXPERTS // world * 4)
        # fp32 masters (bf16 only) and AdamW's two states over the peers: 1/W of all experts, + one `step` scalar
        assert got["master_weights"] == (EXPERTS // world * 4 if c == 2 else 0)
        assert got["optimizer_states"] == EXPERTS // world * 8 + 4
        assert got["flat_stage3_parameters"] == EXPERTS * c // world


def test_stage_3_holds_what_flat_stage_3_holds_at_every_ep() -> None:
    """At stage 3 the experts' share of every kind is 1/W, as flat stage 3's: at ep = W (each rank alone holds
    its experts) and at ep < W (the local experts cut over their peers, [Note: experts below 1/ep at stage 3]), so
    the totals differ by the padding of flat stage 3's units only. Every tensor partitioned: at the default threshold
    flat stage 3 would keep these tiny experts whole (persistent), and so would expert parallelism (their local
    size). Stage 2 keeps the local experts' parameters whole: 1/ep instead of 1/W."""
    zero = ZeroConfig.from_any({"zero_optimization": {"stage3_param_persistence_threshold": 0}}).zero_optimization
    model, setup = _meta_model(), est.TrainingSetup(8, "bf16", "adamw", zero=zero)
    flat = est.estimate_stage(est.shapes_from_module(model, zero), setup, 3).device
    split = ee.estimate_expert_parallel(ee.expert_shapes_from_module(model, 8, zero), setup, 3).device
    for kind in est.MODEL_STATE_KINDS:
        assert split[kind] == pytest.approx(flat[kind], rel=0.02), kind
    for ep in (2, 4):
        shapes = ee.expert_shapes_from_module(model, ep, zero)
        assert len(shapes.local_units) == 4 and not shapes.local_persistent  # one unit per layer
        below = ee.estimate_expert_parallel(shapes, setup, 3).device
        for kind in ("parameters", "gradients", "master_weights"):  # no padding: 1/W of the experts each
            assert below[kind] == split[kind], (ep, kind)
        assert abs(below["optimizer_states"] - split["optimizer_states"]) <= 4 * 4  # AdamW's `step` per unit
        stage_2_rule = ee.estimate_expert_parallel(shapes, setup, 2).device
        rest = est.estimate_stage(shapes.rest, setup, 2).device
        assert stage_2_rule["parameters"] - rest["parameters"] == EXPERTS * 2 // ep  # 1/ep instead of 1/W
    persistent = ee.expert_shapes_from_module(model, 2, ZeroConfig.from_any({}).zero_optimization)
    assert not persistent.local_units and len(persistent.local_persistent) == 8  # under the default threshold


def test_the_cli_reports_stages_1_to_3_and_the_autoep_block(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = write_config(tmp_path / "moe", QWEN3_MOE)
    report = estimate_json(
        capsys, "--config_json", str(folder), "--num_gpus", "8", "--expert_parallel", "4", "--gpu_memory", "80GB"
    )
    assert [(row["stage"], row["offload"]) for row in report["estimates"]] == [(1, "none"), (2, "none"), (3, "none")]
    section = report["expert_parallel"]
    assert section["size"] == 4 and section["peers"] == 2 and section["layers"] == 4
    assert (section["experts_per_layer"], section["experts_per_rank_per_layer"]) == (8, 2)
    assert section["expert_parameters"] == EXPERTS and section["expert_parameters_per_rank"] == EXPERTS // 4
    assert section["expert_bytes_per_rank"]["3"]["parameters"] == EXPERTS // 4 * 2  # bf16 by default
    recommended = report["recommendation"]["deepspeed_config"]
    assert recommended["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    assert report["layouts"] is None and any("expert parallelism 4" in note for note in report["notes"])
    assert not any("nvme rows" in note for note in report["notes"])  # there are none
    setup = est.TrainingSetup(8, "bf16", "adamw")
    expected = ee.estimate_expert_parallel(ee.expert_shapes_from_module(_meta_model(), 4), setup, 2)
    assert report["estimates"][1]["model_states"] == expected.model_states


def test_refusals_name_the_problem(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    moe, dense = write_config(tmp_path / "moe", QWEN3_MOE), write_config(tmp_path / "dense", TINY_LLAMA)
    cases = [
        (["--config_json", str(dense), "--num_gpus", "4", "--expert_parallel", "2"], "no fused experts module"),
        (["--config_json", str(moe), "--num_gpus", "4", "--expert_parallel", "3"], "does not divide the 4 GPUs"),
        (["--config_json", str(moe), "--num_gpus", "16", "--expert_parallel", "16"], "does not divide the experts"),
        (["--params", "7e9", "--num_gpus", "4", "--expert_parallel", "2"], "not --params"),
        (["--config_json", str(moe), "--num_gpus", "4", "--expert_parallel", "2", "--offload", "cpu"], "offload"),
        (["--config_json", str(moe), "--num_gpus", "4", "--expert_parallel", "0"], "--expert_parallel must be"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in err, (argv, err)


def test_the_library_refuses_stage_0_and_offload() -> None:
    shapes, setup = ee.expert_shapes_from_module(_meta_model(), 2), est.TrainingSetup(4)
    with pytest.raises(ValueError, match="stages 1-3"):
        ee.estimate_expert_parallel(shapes, setup, 0)
    with pytest.raises(ValueError, match="offload"):
        ee.estimate_expert_parallel(shapes, setup, 3, "cpu")
    with pytest.raises(ValueError, match="does not divide the 6 GPUs"):
        ee.estimate_expert_parallel(ee.expert_shapes_from_module(_meta_model(), 4), est.TrainingSetup(6), 3)


# bench/expert_parallel.py's model (bench/README.md, "With more tokens"): measured per rank and micro-step at W 4,
# fp32, 2 x 512 tokens: flat stage 3 moved 75.50 MB of expert bytes, ep 2 42.01 MB, ep 4 27.31 MB.
BENCH_MOE = {
    **QWEN3_MOE, "vocab_size": 2000, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_experts": 16, "num_experts_per_tok": 2,
}  # fmt: skip


def test_expert_bytes_against_flat_stage_3_match_the_bench_and_the_cli_says_which_moves_fewer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """[Note: expert bytes against flat stage 3]: the formula against the bench's measured bytes (the all-to-alls'
    route indices, a few kB, are not in it), the crossover, and the estimate's line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in BENCH_MOE.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    setup = est.TrainingSetup(4, "no", "adamw")
    # uniform routing sends (ep - 1)/ep of the rows away; the bench's random router sent 8% more than 3/4 at ep 4
    for ep, measured, within in ((2, 42.01, 5e-3), (4, 27.31, 0.1)):
        shapes = ee.expert_shapes_from_module(model, ep)
        assert (shapes.top_k, shapes.hidden) == (2, 256)
        got = ee.micro_step_bytes(shapes, setup, 1024)
        assert got["flat_stage3"] / 1e6 == pytest.approx(75.50, rel=2e-3)
        assert got["expert_parallel"] / 1e6 == pytest.approx(measured, rel=within)
        crossover = int(got["crossover_tokens"])
        below, above = (ee.micro_step_bytes(shapes, setup, t)["expert_parallel"] for t in (crossover, crossover + 1))
        assert below <= got["flat_stage3"] < above
        goal = int(got["one_ep_th_tokens"])
        below, above = (ee.micro_step_bytes(shapes, setup, t)["expert_parallel"] for t in (goal, goal + 1))
        assert below <= got["flat_stage3"] / ep < above
    # bench/README.md: at ep = W, 1/ep of flat stage 3's up to X / (2 W L k H b) = 767 tokens
    assert ee.micro_step_bytes(ee.expert_shapes_from_module(model, 4), setup, 1)["one_ep_th_tokens"] == (
        pytest.approx(767, abs=1.5)
    )
    folder = write_config(tmp_path / "bench_moe", BENCH_MOE)
    for seq, verdict in ((512, "here expert parallelism moves fewer bytes"), (2048, "here flat stage 3")):
        report = estimate_json(
            capsys, "--config_json", str(folder), "--num_gpus", "4", "--expert_parallel", "2",
            "--micro_batch", "2", "--seq_len", str(seq), "--mixed_precision", "no",
        )  # fmt: skip
        line = next(note for note in report["notes"] if note.startswith("expert bytes per GPU"))
        assert f"at {2 * seq} tokens per GPU" in line and verdict in line, line
