"""The DeepSpeed configs users already have (tests/fixtures/ds_configs: 56 files from 11 public repositories) through
`accelerate-zero validate`: each is accepted, or refused naming only the features it turns on, or the keys DeepSpeed
0.19.8 refuses too ([Note: DeepSpeed's config rule] in config/deepspeed_keys.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest

from accelerate_zero.cli import validate


CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "ds_configs"

REFUSED: dict[str, tuple[tuple[str, ...], bool]] = {
    # file: (the names every problem is about, whether DeepSpeed 0.19.8's DeepSpeedConfig accepts the file)
    "axolotl/zero1_torch_compile.json": (("compile.backend", "compile.disable"), False),
    "axolotl/zero2_torch_compile.json": (("compile.backend", "compile.disable"), False),
    "llama_factory/ds_z3_alst_config.json": (
        (
            "bf16.auto_cast",
            "bf16.hysteresis",
            "bf16.initial_scale_power",
            "bf16.loss_scale",
            "bf16.loss_scale_window",
            "bf16.min_loss_scale",
        ),
        False,
    ),  # fmt: skip
    "megatron_deepspeed/rebase__ds_config_gpt_slw.json": (("curriculum_learning.enabled",), False),
    # DeepSpeed accepts the file and raises when it builds the optimizer from it (engine._configure_basic_optimizer)
    "megatron_deepspeed/curriculum_learning__ds_zero_stage_1_config_baseline.json": (
        ("optimizer.params.max_grad_norm",),
        True,
    ),
    # features that are on and that accelerate_zero does not have
    "deepspeed_chat/step3_actor_hybrid_engine.json": (("hybrid_engine.enabled",), True),
    "deepspeed_chat/step3_actor_mixed_precision_lora.json": (
        ("zero_optimization.zero_quantized_nontrainable_weights",),
        True,
    ),
    "llama_factory/ds_z2_autotp_config.json": (("tensor_parallel.autotp_size",), True),
    "megatron_deepspeed/offload_pp__ds_config_gpt.json": (("zero_optimization.offload_optimizer.ratio",), True),
}
"""Every file not listed here is accepted; DeepSpeed 0.19.8 accepts it too, except those in `LAXER_THAN_DEEPSPEED`."""

LAXER_THAN_DEEPSPEED = {
    "megatron_deepspeed/moe__ds_config_gpt_zero2.json": "DeepSpeed 0.19.8 refuses a curriculum_learning block even "
    "with enabled: false (it removed the feature); an off block changes nothing, so it is accepted with a note",
}

NOTED = {
    "llama_factory/ds_z3_fp8_config.json": ("'comms_config'", "'monitor_config'"),
    "llama_factory/ds_z2_autotp_config.json": (),
    "megatron_deepspeed/moe__ds_config_gpt_zero2.json": ("'curriculum_learning' is off, so it is accepted",),
    "megatron_deepspeed/data_efficiency__ds_config_gpt_1clmetric.json": (),
}
"""Notes a file must produce (a file may produce others)."""


def _files() -> list[str]:
    return sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.suffix in (".json", ".yaml"))


def _validate(name: str) -> tuple[int, list[str], list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = validate.run(argparse.Namespace(config=str(CORPUS / name), world_size=None))
    lines = err.getvalue().splitlines()
    problems = [line[4:] for line in lines if line.startswith("  - ")] if code else []
    notes_at = next((i for i, line in enumerate(lines) if line.startswith("notes")), len(lines))
    notes = [line[4:] for line in lines[notes_at + 1 :] if line.startswith("  - ")]
    return code, problems, notes


def test_the_corpus_is_cited_and_large() -> None:
    """Every file has its row in the README (repository, path, commit) and every row its file."""
    readme = (CORPUS / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| ([\w.-]+/[\w.-]+) \| `[^`]+` \| ([0-9a-f]{40}) \|", readme, re.M)
    assert sorted(row[0] for row in rows) == _files()
    assert len(rows) >= 48 and len({row[1] for row in rows}) >= 11
    assert set(REFUSED) <= set(_files())


@pytest.mark.parametrize("name", _files())
def test_each_config_is_accepted_or_refused_only_for_a_feature_it_turns_on(name: str) -> None:
    code, problems, notes = _validate(name)
    if name not in REFUSED:
        assert (code, problems) == (0, []), problems
    else:
        names, _ = REFUSED[name]
        assert code == validate.INVALID_CONFIG_EXIT_CODE
        named = [next((n for n in names if re.search(re.escape(n) + r"(?!\w)", p)), None) for p in problems]
        assert None not in named, [p for p, n in zip(problems, named, strict=True) if n is None]
        assert set(named) == set(names)
    for expected in NOTED.get(name, ()):
        assert any(expected in note for note in notes), (expected, notes)


# The "auto" values transformers' integration fills (values for a 64-wide model, 1 process), so that DeepSpeed's own
# DeepSpeedConfig can read a file the way a Trainer hands it over.
_FILLED = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
    "gradient_clipping": 1.0, "fp16.enabled": False, "bf16.enabled": False, "bfloat16.enabled": False,
    "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
    "scheduler.params.warmup_num_steps": 10, "scheduler.params.total_num_steps": 100,
    "zero_optimization.reduce_bucket_size": 4096, "zero_optimization.stage3_prefetch_bucket_size": 3686,
    "zero_optimization.stage3_param_persistence_threshold": 640,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}  # fmt: skip


def _fill(node: dict, prefix: str = "") -> None:
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        if value == "auto" and path in _FILLED:
            node[key] = _FILLED[path]
        elif isinstance(value, dict):
            _fill(value, path)


def test_deepspeed_itself_agrees_with_the_corpus_labels() -> None:
    """DeepSpeed 0.19.8 (the test extra's pin) accepts every JSON file the labels say it accepts, and rejects the
    others: "refused fairly" is checked against DeepSpeed, not asserted."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    config_module = pytest.importorskip("deepspeed.runtime.config")
    verdicts = {}
    for name in (n for n in _files() if n.endswith(".json")):
        raw = json.loads((CORPUS / name).read_text())
        _fill(raw)
        try:
            config_module.DeepSpeedConfig(raw)
            verdicts[name] = True
        except Exception:  # pydantic's ValidationError, DeepSpeedConfigError, AssertionError: all "rejects"
            verdicts[name] = False
    expected = {name: REFUSED[name][1] if name in REFUSED else name not in LAXER_THAN_DEEPSPEED for name in verdicts}
    assert verdicts == expected
