"""`accelerate-zero estimate`: the seeds' memory table, offload, the recommendation, and the JSON schema."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_zero.cli import estimate as cli
from accelerate_zero.config.schema import ZeroOptimizationConfig
from accelerate_zero.debug import estimate as est
from accelerate_zero.debug import model_source


PSI, W = 7e9, 8
# Model-state bytes per device, from the seeds' table (000: ZeRO stages; 16 bytes per parameter with Adam).
MIXED_PRECISION_ADAM = {0: 16 * PSI, 1: 4 * PSI + 12 * PSI / W, 2: 2 * PSI + 14 * PSI / W, 3: 16 * PSI / W}
FP32_ADAM = {0: 16 * PSI, 1: 8 * PSI + 8 * PSI / W, 2: 4 * PSI + 12 * PSI / W, 3: 16 * PSI / W}
# The table assumes half-precision gradients; under bf16 the engine accumulates them in fp32 unless
# `data_types.grad_accum_dtype` says otherwise ([Note: fp32 gradients under mixed precision]): 2 + 4 + 12 bytes.
MIXED_PRECISION_FP32_GRADS_ADAM = {0: 18 * PSI, 1: 6 * PSI + 12 * PSI / W, 2: 2 * PSI + 16 * PSI / W, 3: 18 * PSI / W}
LLAMA_13B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
TINY_LLAMA = {**LLAMA_13B, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3}
TINY_LLAMA.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Runs `accelerate-zero estimate ARGV` through a parser of our own (main.py registers it the same way)."""
    parser = argparse.ArgumentParser(prog="accelerate-zero")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate", *argv])
    code = args.run(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def estimate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ------------------------------------------------------------------------------------------- known cases
@pytest.mark.parametrize(("precision", "expected"), [("bf16", MIXED_PRECISION_ADAM), ("no", FP32_ADAM)])
@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_seven_billion_on_eight_devices_matches_the_seeds_table(
    precision: str, expected: dict, optimizer: str
) -> None:
    shapes = est.shapes_from_count(int(PSI))
    # the seeds' table keeps gradients in the compute dtype, as DeepSpeed does by default
    setup = est.TrainingSetup(W, precision, optimizer, grad_accum_dtype=None if precision == "no" else precision)
    for stage, bytes_per_device in expected.items():
        got = est.estimate_stage(shapes, setup, stage)
        assert got.model_states == pytest.approx(bytes_per_device, rel=1e-3), stage


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_mixed_precision_counts_fp32_gradients_by_default(optimizer: str) -> None:
    shapes = est.shapes_from_count(int(PSI))
    for stage, bytes_per_device in MIXED_PRECISION_FP32_GRADS_ADAM.items():
        got = est.estimate_stage(shapes, est.TrainingSetup(W, "bf16", optimizer), stage)
        assert got.model_states == pytest.approx(bytes_per_device, rel=1e-3), stage


def test_the_cli_reports_the_same_model_states(capsys: pytest.CaptureFixture[str]) -> None:
    report = estimate_json(capsys, "--params", "7e9", "--num_gpus", "4", "--num_nodes", "2", "--offload", "none")
    assert report["setup"]["world_size"] == W
    for row in report["estimates"]:
        assert row["model_states"] == pytest.approx(MIXED_PRECISION_FP32_GRADS_ADAM[row["stage"]], rel=1e-3)


def test_kinds_follow_the_engine_rules_per_stage() -> None:
    shapes, setup = est.shapes_from_count(int(PSI)), est.TrainingSetup(W, "bf16", "adamw")
    s0, s1, s2, s3 = (est.estimate_stage(shapes, setup, stage).device for stage in est.STAGES)
    assert s0["parameters"] == s1["parameters"] == s2["parameters"] == pytest.approx(2 * PSI, rel=1e-6)
    # fp32 gradients under bf16 ([Note: fp32 gradients under mixed precision]); stage 1 reduce-scatters in place
    assert s1["gradients"] == pytest.approx(4 * PSI, rel=1e-6)
    assert s2["gradients"] == s3["gradients"] == pytest.approx(4 * PSI / W, rel=1e-6)
    bf16_grads = dataclasses.replace(setup, grad_accum_dtype="bf16")
    assert est.estimate_stage(shapes, bf16_grads, 2).device["gradients"] == pytest.approx(2 * PSI / W, rel=1e-6)
    assert s3["parameters"] == pytest.approx(2 * PSI / W, rel=1e-6)
    assert s1["master_weights"] == pytest.approx(4 * PSI / W, rel=1e-6)
    assert s0["communication_buffers"] == s1["communication_buffers"] == 0
    assert s2["communication_buffers"] > 0 and s3["gathered_parameters"] > 0  # transient, not model states


def test_fp32_master_weights_are_the_parameters() -> None:
    shapes = est.shapes_from_count(10**6)
    for stage in est.STAGES:
        assert est.estimate_stage(shapes, est.TrainingSetup(4, "no", "adamw"), stage).device["master_weights"] == 0


@pytest.mark.parametrize(("optimizer", "bytes_per_element"), [("sgd", 0), ("sgd_momentum", 4), ("adagrad", 4)])
def test_optimizer_states_per_parameter(optimizer: str, bytes_per_element: int) -> None:
    got = est.estimate_stage(est.shapes_from_count(10**8), est.TrainingSetup(1, "bf16", optimizer), 0)
    assert got.device["optimizer_states"] == pytest.approx(bytes_per_element * 10**8, abs=16)


# ------------------------------------------------------------------------------------------------ offload
def test_cpu_offload_moves_master_and_states_to_cpu_ram() -> None:
    shapes, setup = est.shapes_from_count(int(PSI)), est.TrainingSetup(W, "bf16", "adamw")
    for stage in (1, 2, 3):
        kept = est.estimate_stage(shapes, setup, stage)
        moved = est.estimate_stage(shapes, setup, stage, "cpu")
        assert moved.device["master_weights"] == moved.device["optimizer_states"] == 0
        assert moved.host["master_weights"] == kept.device["master_weights"]
        assert moved.host["optimizer_states"] == kept.device["optimizer_states"]
        assert moved.host["gradients"] == pytest.approx(4 * PSI / W, rel=1e-6)  # fp32 slice the CPU optimizer steps
        assert moved.device["parameters"] == kept.device["parameters"] and moved.nvme["total"] == 0


def test_parameter_offload_and_nvme_at_stage_3() -> None:
    shapes, setup = est.shapes_from_count(int(PSI)), est.TrainingSetup(W, "bf16", "adamw")
    cpu = est.estimate_stage(shapes, setup, 3, "cpu+param")
    nvme = est.estimate_stage(shapes, setup, 3, "nvme")
    assert cpu.device["parameters"] == nvme.device["parameters"] == 0
    assert cpu.host["parameters"] == nvme.nvme["parameters"] == pytest.approx(2 * PSI / W, rel=1e-6)
    assert nvme.nvme["optimizer_states"] == pytest.approx(8 * PSI / W, rel=1e-6)
    # ZeRO-Infinity: the fp32 gradient slice goes to files as well; CPU RAM holds the sub-groups being stepped
    assert nvme.nvme["gradients"] == pytest.approx(4 * PSI / W, rel=1e-6)
    resident = min(PSI / W, est.NVME_RESIDENT_SUBGROUPS * setup.zero.sub_group_size)
    assert nvme.host["total"] == pytest.approx(16 * resident, rel=1e-6)
    small = est.TrainingSetup(W, "bf16", "adamw", zero=dataclasses.replace(setup.zero, sub_group_size=10**6))
    assert est.estimate_stage(shapes, small, 3, "nvme").host["total"] == 16 * 4 * 10**6


def test_fp32_offload_needs_a_host_master_copy() -> None:
    moved = est.estimate_stage(est.shapes_from_count(10**6), est.TrainingSetup(2, "no", "adamw"), 2, "cpu")
    assert moved.host["master_weights"] == 4 * 10**6 // 2


@pytest.mark.parametrize(("stage", "offload"), [(0, "cpu"), (1, "nvme"), (2, "cpu+param"), (4, "none")])
def test_combinations_deepspeed_lacks_are_refused(stage: int, offload: str) -> None:
    assert not est.is_applicable(stage, offload)
    with pytest.raises(ValueError, match="is_applicable"):
        est.estimate_stage(est.shapes_from_count(100), est.TrainingSetup(2), stage, offload)


def test_cpu_ram_is_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    report = estimate_json(capsys, "--params", "1e9", "--num_gpus", "4", "--num_nodes", "2", "--offload", "cpu")
    for row in report["estimates"]:
        assert row["cpu_ram_per_node"] == 4 * row["host_per_rank"]["total"] > 0


# ----------------------------------------------------------------------------------------- recommendation
def test_thirteen_billion_on_four_a100_80gb(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Seed 001: "13B model, 4x A100 80GB: Stage 2 or 3"; stage 2 first, stage 3 only if stage 2 does not fit."""
    folder = write_config(tmp_path / "llama-13b", LLAMA_13B)
    common = ["--num_gpus", "4", "--gpu_memory", "80GB", "--mixed_precision", "bf16", "--seq_len", "2048"]
    # With DeepSpeed's bf16 gradients (2 + 2 + 12 bytes per parameter) stage 2 fits: 2 * 13e9 + 14 * 13e9 / 4 bytes.
    bf16_grads = tmp_path / "bf16_grads.json"
    bf16_grads.write_text(json.dumps({"data_types": {"grad_accum_dtype": "bf16"}}))
    checkpointed = estimate_json(
        capsys,
        "--config_json",
        str(folder),
        *common,
        "--gradient_checkpointing",
        "--deepspeed_config",
        str(bf16_grads),
    )
    assert checkpointed["model"]["num_parameters"] == pytest.approx(13.0e9, rel=0.01)
    assert checkpointed["recommendation"]["stage"] == 2 and checkpointed["recommendation"]["offload"] == "none"
    # The engine's default fp32 gradients ([Note: fp32 gradients under mixed precision]) make stage 2 hold
    # 2 * 13e9 + 16 * 13e9 / 4 = 78 GB of model states, over the 72 GiB budget: stage 3, the seed's other answer.
    default = estimate_json(capsys, "--config_json", str(folder), *common, "--gradient_checkpointing")
    assert (default["recommendation"]["stage"], default["recommendation"]["offload"]) == (3, "none")
    # Without checkpointing 40 layers of activations (~14 GiB) no longer fit beside stage 2's full parameters.
    plain = estimate_json(
        capsys, "--config_json", str(folder / "config.json"), *common, "--deepspeed_config", str(bf16_grads)
    )
    assert (plain["recommendation"]["stage"], plain["recommendation"]["offload"]) == (3, "none")
    assert plain["recommendation"]["deepspeed_config"] == {"zero_optimization": {"stage": 3}}
    fits = {(r["stage"], r["offload"]): r["fits"] for r in plain["estimates"]}
    assert fits[(0, "none")] is fits[(1, "none")] is fits[(2, "none")] is False
    # ... and with fp32 gradients not beside stage 3's either (62 GiB + 14 GiB): the optimizer goes to the CPU.
    plain_default = estimate_json(capsys, "--config_json", str(folder / "config.json"), *common)
    assert (plain_default["recommendation"]["stage"], plain_default["recommendation"]["offload"]) == (2, "cpu")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--num_nodes", "4", "--gpu_memory", "80GB"], (3, "none")),  # 16 * 70e9 / 32 = 35 GB per GPU
        (["--gpu_memory", "80GB"], (3, "cpu")),  # 16 * 70e9 / 8 = 140 GB: only the optimizer offloaded fits
        (["--gpu_memory", "16GB"], (3, "cpu+param")),
        (["--gpu_memory", "16GB", "--cpu_memory", "512GB"], (3, "nvme")),  # 8 ranks' CPU states need ~1.1 TiB
    ],
)
def test_offload_only_when_nothing_else_fits(
    capsys: pytest.CaptureFixture[str], flags: list[str], expected: tuple[int, str]
) -> None:
    report = estimate_json(capsys, "--params", "70e9", "--num_gpus", "8", *flags)
    assert (report["recommendation"]["stage"], report["recommendation"]["offload"]) == expected
    zero = report["recommendation"]["deepspeed_config"]["zero_optimization"]
    assert zero["stage"] == 3 and ("offload_optimizer" in zero) == (expected[1] != "none")


def test_nothing_fits_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    report = estimate_json(
        capsys, "--params", "70e9", "--num_gpus", "1", "--gpu_memory", "8GB", "--cpu_memory", "16GB"
    )
    assert report["recommendation"] is None
    assert any("nothing fits" in note for note in report["notes"])


def test_without_gpu_memory_there_is_no_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    report = estimate_json(capsys, "--params", "1e9", "--num_gpus", "2")
    assert report["recommendation"] is None and all(row["fits"] is None for row in report["estimates"])


# ------------------------------------------------------------------------------------------ model inputs
def test_a_config_is_counted_on_the_meta_device(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    loaded = model_source.load_from_config(write_config(tmp_path / "tiny", TINY_LLAMA) / "config.json")
    assert all(p.device.type == "meta" for p in loaded.module.parameters())
    real = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    zero = ZeroOptimizationConfig(stage3_param_persistence_threshold=0)
    assert loaded.shapes(zero) == est.shapes_from_module(real, zero, architecture=loaded.architecture)
    assert loaded.shapes(zero).numel == sum(p.numel() for p in real.parameters())  # tied head counted once
    assert loaded.architecture == est.Architecture(hidden_size=32, num_layers=3, num_heads=4, vocab_size=64)


def test_safetensors_headers_give_the_same_layout(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    real = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": False}))
    tensors = {name: p.detach().contiguous() for name, p in real.named_parameters()}
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[len(names) // 2 :]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    loaded = model_source.load_from_folder(tmp_path)
    assert loaded.source == "safetensors"
    zero = ZeroOptimizationConfig(stage3_param_persistence_threshold=0)
    from_headers, from_model = loaded.shapes(zero), est.shapes_from_module(real, zero)
    assert from_headers.numel == from_model.numel
    # decoder layers become the units, as _no_split_modules says; the rest is the root unit
    assert sorted(map(sorted, from_headers.units)) == sorted(map(sorted, from_model.units))
    setup = est.TrainingSetup(2, "bf16")
    for stage in est.STAGES:
        assert est.estimate_stage(from_headers, setup, stage).model_states == pytest.approx(
            est.estimate_stage(from_model, setup, stage).model_states, rel=1e-3
        )


def test_a_model_folder_prefers_its_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = write_config(tmp_path / "model", TINY_LLAMA)
    report = estimate_json(capsys, "--model", str(folder), "--num_gpus", "2")
    assert report["model"]["source"] == "config" and report["model"]["name"] == "LlamaForCausalLM"
    assert report["activations"] > 0


def test_persistence_threshold_comes_from_the_deepspeed_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = write_config(tmp_path / "tiny", TINY_LLAMA)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": "auto", "stage3_param_persistence_threshold": "auto"}}))
    # transformers fills the "auto" threshold with 10 * hidden_size = 320: the norms stay whole, matrices do not
    report = estimate_json(capsys, "--config_json", str(folder), "--deepspeed_config", str(ds), "--offload", "none")
    assert 0 < report["model"]["persistent_parameters"] < report["model"]["num_parameters"]
    ds.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    report = estimate_json(capsys, "--config_json", str(folder), "--deepspeed_config", str(ds))
    assert report["model"]["persistent_parameters"] == 0
    assert report["setup"]["mixed_precision"] == "no"  # the DeepSpeed config enables neither bf16 nor fp16


def test_bad_inputs_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "--model", str(tmp_path))
    assert code == 2 and "no usable config.json" in err
    code, _, err = run_cli(capsys, "--params", "1e9", "--headroom", "1.5", "--num_nodes", "0")
    assert code == 2 and "--headroom" in err and "--num_nodes" in err


@pytest.mark.parametrize(
    ("text", "expected"), [("80GB", 80 * 2**30), ("80GiB", 80 * 2**30), ("512g", 512 * 2**30), ("1024", 1024)]
)
def test_sizes_are_binary(text: str, expected: int) -> None:
    assert cli.parse_size(text) == expected


@pytest.mark.parametrize(("text", "expected"), [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("350m", 350 * 10**6)])
def test_parameter_counts(text: str, expected: int) -> None:
    assert cli.parse_count(text) == expected


def test_activation_estimate_follows_the_formula() -> None:
    arch = est.Architecture(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000)
    s, b, h = 2048, 1, 4096
    plain = est.activation_bytes(arch, micro_batch=b, seq_len=s, compute_bytes=2)
    assert plain == 32 * 34 * s * b * h + s * b * 32000 * 10
    eager = est.activation_bytes(arch, micro_batch=b, seq_len=s, compute_bytes=2, eager_attention=True)
    assert eager - plain == 32 * 5 * 32 * s * s * b
    checkpointed = est.activation_bytes(arch, micro_batch=b, seq_len=s, compute_bytes=2, gradient_checkpointing=True)
    assert checkpointed == 32 * 2 * s * b * h + 34 * s * b * h + s * b * 32000 * 10


# ------------------------------------------------------------------------------------------------ output
def test_json_has_the_documented_schema(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = write_config(tmp_path / "tiny", TINY_LLAMA)
    report = estimate_json(capsys, "--config_json", str(folder), "--num_gpus", "2", "--gpu_memory", "1GB")
    assert set(report) == {
        "schema_version",
        "model",
        "setup",
        "activations",
        "estimates",
        "recommendation",
        "expert_parallel",
        "layouts",
        "notes",
    }
    assert report["expert_parallel"] is None  # without --expert_parallel (tests/unit/test_estimate_experts.py)
    assert report["schema_version"] == 1 and isinstance(report["activations"], int)
    model_types = {"source": str, "name": str, "num_parameters": int, "stage3_units": int}
    model_types.update(persistent_parameters=int, exact_layout=bool, architecture=dict)
    assert {key: type(report["model"][key]) for key in model_types} == model_types and len(report["model"]) == 7
    setup_ints = ("num_gpus", "num_nodes", "world_size", "micro_batch", "seq_len", "gpu_memory", "usable_gpu_memory")
    assert all(isinstance(report["setup"][key], int) for key in setup_ints)
    assert report["setup"]["cpu_memory"] is None and isinstance(report["setup"]["headroom"], float)
    assert [(r["stage"], r["offload"]) for r in report["estimates"]] == [
        (s, o) for s in est.STAGES for o in est.OFFLOAD_MODES if est.is_applicable(s, o)
    ]
    device_kinds = {*est.DEVICE_KINDS, "activations", "total"}
    for row in report["estimates"]:
        keys = {"stage", "offload", "device", "model_states", "host_per_rank", "nvme_per_rank", "fits"}
        assert set(row) == keys | {"cpu_ram_per_node", "nvme_per_node", "phases", "step_seconds"}
        assert row["step_seconds"] is None  # no measured figures given (tests/unit/test_estimate_step_time.py)
        assert list(row["phases"]) == ["init", "forward", "backward", "optimizer_step", "between_steps"]
        assert all(isinstance(v, int) for v in row["phases"].values())
        assert set(row["device"]) == device_kinds and all(isinstance(v, int) for v in row["device"].values())
        assert row["device"]["total"] == sum(v for k, v in row["device"].items() if k != "total")
        assert set(row["host_per_rank"]) == set(row["nvme_per_rank"]) == {*est.MODEL_STATE_KINDS, "total"}
        assert isinstance(row["fits"], bool)
    assert set(report["recommendation"]) == {"stage", "offload", "deepspeed_config"}
    assert all(isinstance(note, str) for note in report["notes"])


def test_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--params", "13e9", "--num_gpus", "4", "--gpu_memory", "80GB")
    assert code == 0
    assert "stage  offload" in out and "GPU total" in out and "CPU/node" in out
    assert "recommendation: ZeRO stage 3 without offload" in out and "GiB" in out  # stage 2 holds 78 GB
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2 * 9  # every applicable combination, in the kinds table and in the per-phase table
    assert "peak per GPU in each phase" in out and "between steps" in out


def test_estimate_is_a_pure_function_of_shapes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Linear(15, 3))
    zero = ZeroOptimizationConfig()
    assert est.shapes_from_module(model, zero) == est.shapes_from_module(model, zero)
    assert est.estimate_stage(est.shapes_from_module(model, zero), est.TrainingSetup(3), 2, rank=2).device["total"] > 0
