"""GRPO and DPO under Ulysses sequence parallelism equal them without it ([Note: GRPO under sequence parallelism] in
accelerate_zero/integrations/trl/sequence_parallel.py, [Note: per-token values under sequence parallelism] in
accelerate_zero/sequence/token_logps.py).

`ZeroGRPOTrainer` with `ParallelismConfig(sp_backend="deepspeed", sp_size=2)` against the same trainer without sequence
parallelism on as many ranks, the same completions (tests/integration/trl_numerics.py's fixed ones: uneven lengths,
left-padded prompts of several lengths), fp32, ZeRO-3, a reference model (beta > 0) and a generation batch of two
steps (so that the old policy's log-probabilities are computed too): every compared logged number and the trained
weights within 1e-5, for TRL's `loss_type` normalisations (sp 2) and at sp 2 x dp 2 with tiled MLPs and LM head.
`ZeroDPOTrainer` likewise (chosen and rejected of uneven lengths), at sp 2 also against TRL's own `DPOTrainer` in one
process on the whole batch, evaluated over cut sequences, and resumed inside the epoch at sp 2 and sp 1. The runs
without sp are TRL's arithmetic on each rank (tests/integration/test_trl_numerics.py checks them against TRL in one
process), so sp 2 equals one process on the same completions wherever TRL's dp does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed


pytest.importorskip("trl")

LOSS_TYPES = ("dapo", "grpo", "bnpo", "luspo", "cispo")
"""TRL's normalisations: the generation batch's tokens (dapo, TRL's default; cispo, with its own clipping), each
sequence's mean (grpo), the micro-batch's tokens (bnpo) and the sequence-level ratio (luspo). dr_grpo, sapo and vespo
differ from these only in per-token arithmetic that runs on whole values as without sp: they are checked on the
trained model's last generation batch (`_after_training`; training all eight took 241 s on 2 shared cores)."""
GRPO_ACCEPTED = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
"""Every `loss_type` the installed TRL's GRPOConfig names (`test_every_grpo_loss_type_is_checked` keeps this list
TRL's)."""
PER_RANK, ACCUMULATION, STEPS_PER_GENERATION, STEPS = 2, 2, 4, 2
COMPARED = ("loss", "kl", "entropy", "reward", "completions/mean_length", "clip_ratio/region_mean")


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import accelerate_zero

    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grpo(folder: Path, world_size: int, sp: int, loss_type: str, tiling: dict | None) -> dict[str, Any]:
    from accelerate import ParallelismConfig
    from datasets import Dataset
    from transformers import AutoTokenizer

    from accelerate_zero.integrations.trl import ZeroGRPOConfig, ZeroGRPOTrainer
    from tests.integration import trl_numerics

    prompts = world_size * PER_RANK * STEPS_PER_GENERATION // trl_numerics.GENERATIONS
    data = Dataset.from_list(
        [{"prompt": r["messages"][0]["content"], "answer": r["answer"]} for r in trl_numerics.letters(prompts)]
    )
    zero = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if tiling:
        zero["sequence_tiling"] = tiling
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    args = ZeroGRPOConfig(
        output_dir=str(folder / f"run-{world_size}-{sp}-{loss_type}"),
        zero_config=zero,
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=sp) if sp > 1 else None,
        max_steps=STEPS,
        per_device_train_batch_size=PER_RANK,
        gradient_accumulation_steps=ACCUMULATION,
        steps_per_generation=STEPS_PER_GENERATION,
        num_generations=trl_numerics.GENERATIONS,
        max_completion_length=4,
        beta=0.1,
        loss_type=loss_type,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        bf16=False,
        disable_dropout=True,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **extra,
    )
    model_dir = str(folder / "model")
    trainer = trl_numerics.with_fixed_completions(ZeroGRPOTrainer)(
        model=trl_numerics.load(model_dir),
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=trl_numerics.reward,
    )
    trainer.train()
    return {
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "params": _gathered(trainer.model),
        "traffic": sorted(trainer.zero_engine.comm_stats()),
        "attention": trainer.ref_model.config._attn_implementation,
        **(_after_training(trainer, sp) if loss_type == LOSS_TYPES[0] else {}),
    }


def _after_training(trainer: Any, sp: int) -> dict[str, Any]:
    """On the trained policy and its last generation batch (old-policy ratios off 1, a reference model): the loss of
    every token-level `loss_type` TRL accepts (luspo, sequence-level, is trained above); the per-token
    log-probabilities of 1 row on even ranks and 2 on odd ones (uneven row counts in each group); at sp 2, those rows
    scored one at a time (1 call against 2 over the group: refused on every rank instead of hanging)."""
    trainer.model.train()
    inputs = trainer._buffered_inputs[0]
    losses = {}
    with torch.no_grad():
        for name in GRPO_ACCEPTED:
            if name != "luspo":  # luspo needs importance_sampling_level="sequence": trained in its own run
                trainer.loss_type = name
                losses[name] = trainer.compute_loss(trainer.model, inputs).item()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep, rows = inputs["completion_ids"].shape[1], 1 + torch.distributed.get_rank() % 2
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids[:rows], mask[:rows], keep)[0]
        refused = "nothing raised"
        if sp > 1:
            try:
                trainer._get_per_token_logps_and_entropies(trainer.model, ids[:rows], mask[:rows], keep, batch_size=1)
            except ValueError as error:
                refused = str(error)
    return {"losses": losses, "uneven_logps": logps, "uneven_calls": refused}


DPO_LOSS_TYPES = (["sigmoid"], ["ipo", "sft"])
"""TRL's default, and loss types that read the sequences' log-probabilities otherwise (IPO's squared margin; `sft`
adds the chosen tokens' mean, per rank: TRL's DPO on two ranks differs from one process there, sp or not)."""


def _dpo(
    folder: Path,
    world_size: int,
    sp: int | None,
    loss_type: list[str],
    resume: str | None = None,
    name: str = "",
    tiling: dict | None = None,
) -> dict[str, Any]:
    """DPO on 2 steps of 2 accumulated batches; sp None: TRL's own DPOTrainer in one process on the whole batch.
    `resume`: from that checkpoint folder; `name` "saving": a checkpoint after each step, "eval": evaluated after
    training (over cut sequences at sp 2: `sequence_parallel_evaluation`)."""
    import trl
    from accelerate import ParallelismConfig
    from transformers import AutoTokenizer

    from accelerate_zero.integrations.trl import ZeroDPOConfig, ZeroDPOTrainer
    from tests.integration import trl_numerics

    values: dict[str, Any] = dict(
        output_dir=str(folder / f"dpo-{world_size}-{sp}-{'-'.join(loss_type)}{name}"),
        max_steps=STEPS,
        per_device_train_batch_size=PER_RANK if sp is not None else PER_RANK * world_size,
        gradient_accumulation_steps=ACCUMULATION,
        train_sampling_strategy="sequential",
        loss_type=loss_type,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        bf16=False,
        disable_dropout=True,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="steps" if name == "saving" else "no",
        save_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    if sp is None:
        config, cls = trl.DPOConfig(**values), trl.DPOTrainer
    else:
        zero = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        if tiling and sp > 1:
            zero["sequence_tiling"] = tiling
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp) if sp > 1 else None
        cut_eval = name == "eval" and sp > 1
        config = ZeroDPOConfig(
            zero_config=zero, parallelism_config=parallelism, sequence_parallel_evaluation=cut_eval, **values
        )
        cls = ZeroDPOTrainer
    model_dir = str(folder / "model")
    trainer = cls(
        model=trl_numerics.load(model_dir),
        args=config,
        train_dataset=trl_numerics.dataset("dpo"),
        eval_dataset=trl_numerics.dataset("dpo").select(range(6)) if name == "eval" else None,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.train(resume_from_checkpoint=resume)
    params = (
        _gathered(trainer.model)
        if sp is not None
        else {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    )
    traffic = sorted(trainer.zero_engine.comm_stats()) if sp is not None else []
    out = {"logs": [log for log in trainer.state.log_history if "loss" in log], "params": params, "traffic": traffic}
    if name == "eval":
        before = _value_exchanges(trainer)
        out["eval"] = trainer.evaluate()
        out["eval_exchanges"] = _value_exchanges(trainer) - before
    return out


def _value_exchanges(trainer: Any) -> int:
    return int(trainer.zero_engine.comm_stats().get("all_to_all_sequence_values", {}).get("calls", 0))


TILED = {"mlp_tile_tokens": 2, "logits_tile_tokens": 3}
"""MLPs and the LM head in tiles ([Note: tiling along the sequence]): the logits of 3 positions at a time."""


def _runs(rank: int, world_size: int, folder: str, grpo: list[tuple[str, dict | None]], dpo: list) -> dict[str, Any]:
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    root = Path(folder)
    out: dict[Any, Any] = {}
    for loss_type, tiling in grpo:
        for sp in (1, 2):
            out[(loss_type, sp)] = _grpo(root, world_size, sp, loss_type, tiling if sp > 1 else None)
    if world_size == 2:  # tiling alone (sp 1): the one-rank group scores in tiles
        out[("tiled", 1)] = _grpo(root, world_size, 1, grpo[0][0], TILED)
    for index, loss_type in enumerate(dpo):
        for sp in (1, 2):
            name = "eval" if index == 0 else ""
            tiling = grpo[0][1] if grpo else None  # the group's tiling, as its GRPO runs'
            out[("dpo", *loss_type, sp)] = _dpo(root, world_size, sp, loss_type, name=name, tiling=tiling)
    if world_size == 2:  # resumed inside the epoch, at sp 2 and at sp 1, from a checkpoint saved at sp 2
        _dpo(root, world_size, 2, dpo[0], name="saving")
        checkpoint = str(root / f"dpo-{world_size}-2-{'-'.join(dpo[0])}saving" / "checkpoint-1")
        for sp in (1, 2):
            out[("resumed", sp)] = _dpo(root, world_size, sp, dpo[0], resume=checkpoint, name=f"resumed{sp}")
    return out


def _one_process_dpo(rank: int, world_size: int, folder: str, dpo: list) -> dict[str, Any]:
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    return {("dpo", *loss_type): _dpo(Path(folder), 2, None, loss_type) for loss_type in dpo}


DPO_COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _compare(ours: dict[str, Any], theirs: dict[str, Any], where: str, keys: tuple[str, ...] = COMPARED) -> None:
    assert len(ours["logs"]) == len(theirs["logs"]) == STEPS, where
    for step, (mine, ref) in enumerate(zip(ours["logs"], theirs["logs"], strict=True)):
        for key in keys:
            if key in ref:
                assert mine[key] == pytest.approx(ref[key], abs=1e-5), (where, step, key, mine[key], ref[key])
    error = max((ours["params"][n] - p).abs().max().item() for n, p in theirs["params"].items())
    assert error <= 1e-5, (where, error)


@pytest.mark.parametrize(
    ("world_size", "grpo", "dpo"),
    [
        pytest.param(2, [(loss_type, None) for loss_type in LOSS_TYPES], DPO_LOSS_TYPES, id="sp2"),
        pytest.param(4, [("dapo", TILED)], [["sigmoid"]], id="sp2xdp2-tiled"),
    ],
)
def test_grpo_and_dpo_under_sequence_parallelism_equal_them_without(
    tmp_path: Path, world_size: int, grpo: list, dpo: list
) -> None:
    from tests.integration import trl_numerics

    trl_numerics.build_model(tmp_path / "model")
    ranks = run_distributed(_runs, world_size, str(tmp_path), grpo, dpo, timeout=900)
    one_process = run_distributed(_one_process_dpo, 1, str(tmp_path), dpo)[0] if world_size == 2 else {}
    for rank, runs in enumerate(ranks):
        for loss_type, _ in grpo:
            ours, theirs = runs[(loss_type, 2)], runs[(loss_type, 1)]
            assert "all_to_all_sequence_values" in ours["traffic"], "the values were computed over cut sequences"
            assert ours["attention"].startswith("accelerate_zero_ulysses_"), "the reference model ran Ulysses"
            assert theirs["logs"][-1]["kl"] != 0.0, "the reference model's terms are compared"
            _compare(ours, theirs, f"rank {rank} GRPO {loss_type}")
            if "losses" in theirs:  # every other loss type on the trained model, and uneven row counts
                assert ours["losses"].keys() == set(GRPO_ACCEPTED) - {"luspo"}
                assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-5), rank
                assert ours["uneven_logps"].shape[0] == 1 + rank % 2
                assert (ours["uneven_logps"] - theirs["uneven_logps"]).abs().max().item() <= 1e-5, rank
                assert "hold [1, 2] rows, scored 1 at a time: [1, 2] calls" in ours["uneven_calls"], rank
        if ("tiled", 1) in runs:
            _compare(runs[("tiled", 1)], runs[(grpo[0][0], 1)], f"rank {rank} GRPO tiled at sp 1")
        for loss_type in dpo:
            ours, theirs = runs[("dpo", *loss_type, 2)], runs[("dpo", *loss_type, 1)]
            assert "all_to_all_sequence_values" in ours["traffic"]
            _compare(ours, theirs, f"rank {rank} DPO {loss_type}", DPO_COMPARED)
            if loss_type == dpo[0]:  # evaluated over cut sequences at sp 2, whole at sp 1: the same numbers
                assert ours["eval_exchanges"] > 0 and theirs["eval_exchanges"] == 0
                for key, value in theirs["eval"].items():
                    if key.startswith(("eval_loss", "eval_rewards", "eval_logps")):
                        assert ours["eval"][key] == pytest.approx(value, abs=1e-5), (rank, key)
            if ("resumed", 2) in runs and loss_type == dpo[0]:
                for sp in (1, 2):  # the step after the checkpoint, as in the run that never stopped
                    resumed = runs[("resumed", sp)]
                    # the checkpoint's log history holds step 1; step 2 is the resumed run's
                    assert len(resumed["logs"]) == STEPS, resumed["logs"]
                    assert resumed["logs"][1]["loss"] == pytest.approx(ours["logs"][1]["loss"], abs=1e-5), sp
                    error = max((resumed["params"][n] - p).abs().max().item() for n, p in ours["params"].items())
                    assert error <= 1e-5, (rank, f"resumed at sp {sp}", error)
            if one_process and "sft" not in loss_type:  # TRL's DPOTrainer on the whole batch
                reference = one_process[("dpo", *loss_type)]
                error = max((ours["params"][n] - p).abs().max().item() for n, p in reference["params"].items())
                assert error <= 1e-5, (rank, loss_type, "against TRL in one process", error)


def test_every_grpo_loss_type_is_checked() -> None:
    """`GRPO_ACCEPTED` is the installed TRL's list (its GRPOConfig's help names them): a loss type TRL adds fails here
    until it is checked under sp."""
    import re

    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    named = help_text.split("Supported values are ", 1)[1].split(". ", 1)[0]
    assert set(re.findall(r"'([a-z_]+)'", named)) == set(GRPO_ACCEPTED)
    assert set(LOSS_TYPES) <= set(GRPO_ACCEPTED)
