"""Ulysses sequence parallelism the way users turn it on: a `ZeroAccelerator` loop (accelerate's
`ParallelismConfig(sp_backend="deepspeed", sp_size=...)`, or the DeepSpeed config key `sequence_parallel_size`),
the transformers Trainer with `TrainingArguments(parallelism_config=...)`, and TRL's SFT trainer.

Each rank's loader gives it its own padded batches of different lengths (right padding, labels -100 at pads,
`attention_mask`). The run records every batch the loader under the wrapper gave each rank; the reference trains
one process on them: each optimizer step averages the token-mean loss of every batch of that step (what DeepSpeed's
ALST and transformers' `deepspeed_sp_compute_loss` train on). ZeRO-3 over all ranks, gradient accumulation p (each
optimizer step is one batch per rank), SGD, fp32: weights and losses equal the reference to 1e-5.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.sequence_batches import ListCollator, RecordingCollator, gathered, samples, tiny_model


MICRO, STEPS, LR = 2, 2, 0.5
TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "assets" / "tiny-llama"


def _config(sp: int, in_config: bool) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": sp,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    return {**config, "sequence_parallel_size": sp} if in_config else config


def _accelerator_loop(rank: int, world_size: int, sp: int, how: str, tiling: dict | None) -> dict[str, Any]:
    from accelerate import ParallelismConfig

    from accelerate_zero import ZeroAccelerator
    from accelerate_zero.integrations.accelerate import ZeroPlugin
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    kwargs = {"parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=sp)} if how == "argument" else {}
    launch = {"PARALLELISM_CONFIG_SP_SIZE": str(sp), "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    if how == "launch":  # what an accelerate config's `parallelism_config` block exports to the ranks
        os.environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", **launch)
    config = {**_config(sp, how == "config_key"), **({"sequence_tiling": tiling} if tiling else {})}
    try:
        accelerator = ZeroAccelerator(ZeroPlugin(config=config), gradient_accumulation_steps=sp, **kwargs)
    finally:  # the ranks run other tests next: accelerate's `ParallelismConfig()` reads these variables
        plain_torchrun_environment()
        for name in launch:
            os.environ.pop(name, None)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    collator = RecordingCollator()
    loader = torch.utils.data.DataLoader(samples(MICRO * world_size * STEPS), batch_size=MICRO, collate_fn=collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, lengths, whole_logits = [], [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss, outputs = accelerator.sequence_parallel_loss(model, batch, return_outputs=True)
            whole_logits.append(outputs is not None)  # None: the LM head and the loss ran in tiles
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        lengths.append(batch["input_ids"].shape[1])
    seen = list(collator.seen)
    # a resumed loop skips micro-batches: whole batches of the loader under it unread, then pieces of the next
    whole = [piece["input_ids"] for piece in loader]
    skip = len(whole) - 1  # at sp 2: one batch of the loader under it, and one piece of the next
    skipped = [piece["input_ids"] for piece in accelerator.skip_first_batches(loader, skip)]
    model.eval()
    with torch.no_grad():  # evaluation: whole sequences per rank, plain attention
        probe = collator([{"input_ids": torch.arange(1, 12)}])
        eval_logits = model(input_ids=probe["input_ids"]).logits
    engine = accelerator.zero_engines[0]
    return {
        "seen": seen,
        "skips_right": len(skipped) == 1 and torch.equal(skipped[0], whole[-1]),
        "losses": losses,
        "lengths": lengths,
        "len": len(loader),
        "params": gathered(model),
        "eval_logits": eval_logits,
        "traffic": sorted(engine.comm_stats()),
        "steps": engine.global_steps,
        "whole_logits": whole_logits,
        "tiled_mlp": "forward" in vars(model.model.layers[0].mlp),
    }


def _reference(
    seen_by_rank: list[list[dict[str, torch.Tensor]]], steps: int, eval_sample: dict | None = None
) -> dict[str, Any]:
    """One process: step k averages the token-mean losses of batch k of every rank."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for k in range(steps):
        batches = [seen[k] for seen in seen_by_rank]
        step_losses = [model(**batch).loss for batch in batches]
        torch.stack(step_losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in step_losses])
    probe = torch.arange(1, 12)[None]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
        eval_loss = model(**RecordingCollator()([eval_sample])).loss.item() if eval_sample is not None else None
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "losses": losses, "logits": logits, "eval_loss": eval_loss}


def _group_losses(result: dict[str, Any], sp: int) -> list[list[float]]:
    """The run's losses by optimizer step, micro-step i being group rank i's batch."""
    return [result["losses"][k * sp : (k + 1) * sp] for k in range(len(result["losses"]) // sp)]


TILED = {"logits_tile_tokens": 3, "mlp_tile_tokens": 2, "activations_on_host": True}


@pytest.mark.parametrize(
    ("world_size", "sp", "how", "tiling"),
    [
        pytest.param(2, 2, "argument", None, id="sp2-parallelism_config"),
        # ParallelismConfig(sp_size=2) on 4 processes: accelerate fills dp_shard_size=1, dp derived as 4 / 2
        pytest.param(4, 2, "argument", TILED, id="sp2xdp2-parallelism_config-tiled"),
        pytest.param(2, 1, "config_key", TILED, id="sp1-tiled"),
        pytest.param(2, 2, "launch", None, id="sp2-launch_environment"),
    ],
)
def test_zero_accelerator_loop_matches_one_process(world_size: int, sp: int, how: str, tiling: dict | None) -> None:
    results = run_distributed(_accelerator_loop, world_size, sp, how, tiling)
    seen = [result["seen"] for result in results]
    reference = _reference(seen, STEPS)
    for rank, result in enumerate(results):
        assert result["len"] == STEPS * sp, "each batch of the loader under it gives sp micro-batches"
        assert result["steps"] == STEPS
        assert result["skips_right"], "accelerator.skip_first_batches: the last piece after the others are skipped"
        if sp > 1:
            assert "all_to_all_sequence_batch" in result["traffic"] and "all_to_all_sequence" in result["traffic"]
        assert result["whole_logits"] == [tiling is None] * len(result["losses"])
        assert result["tiled_mlp"] == (tiling is not None)
        group = rank - rank % sp
        # micro-step i of a step is group rank i's batch; its loss is that whole batch's, on every rank of the group
        for k in range(STEPS):
            expected = [reference["losses"][k][group + i] for i in range(sp)]
            assert _group_losses(result, sp)[k] == pytest.approx(expected, abs=1e-5), (rank, k)
        owner = [seen[group + i % sp][i // sp]["input_ids"].shape[1] for i in range(STEPS * sp)]
        assert result["lengths"] == [-(-n // sp) for n in owner], "each rank holds 1/sp of the padded sequence"
        error = max((result["params"][n] - p).abs().max().item() for n, p in reference["params"].items())
        assert error <= 1e-5, (rank, error)
        assert (result["eval_logits"] - reference["logits"]).abs().max().item() <= 1e-5, "eval runs whole sequences"


# ---------------------------------------------------------------------------------------------------- the Trainer
# Accumulation 3 over uneven lengths: with sp 2 a step takes pieces of 3 batches, straddling the loader's batches, and
# transformers' rule (every token of the step alike) differs from DeepSpeed ALST's (each micro-batch's mean alike).
TRAINER_ACCUMULATION, TRAINER_STEPS = 3, 4
METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


def _trainer_kwargs(folder: str, sp: int | None, **overrides: Any) -> dict[str, Any]:
    """The run's arguments; sp None: the one-process reference (plain transformers/TRL arguments)."""
    from accelerate import ParallelismConfig

    from tests.integration import trainer_checks as checks

    values = {
        "gradient_accumulation_steps": TRAINER_ACCUMULATION,
        "max_steps": -1,
        "num_train_epochs": 1,  # the Trainer counts an epoch's steps from the cut loader's length
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
    }
    kwargs = checks.args_kwargs(folder, MICRO, **{**values, **overrides})
    if sp is not None:
        kwargs["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp)
        kwargs["zero_config"] = {
            **_config(sp, False),
            "gradient_accumulation_steps": TRAINER_ACCUMULATION,
            "train_micro_batch_size_per_gpu": "auto",
        }
    return kwargs


def _trainer_data(world_size: int) -> list[dict[str, torch.Tensor]]:
    """Batches in order (sequential sampling): rank r reads batches r, r + world, ...; the group's micro-batches
    are its members' batches in rank order, so the run's micro-batches are the one process's, in its order."""
    return samples(MICRO * TRAINER_ACCUMULATION * TRAINER_STEPS)


def _train(folder: str, sp: int | None, trl: bool, data: list, resume: str | None = None, **overrides: Any) -> Any:
    """Builds and trains the Trainer (ours with sp, else transformers' or TRL's own in one process), from the
    checkpoint `resume` if given."""
    collator = RecordingCollator()
    model = tiny_model()
    if trl:
        from datasets import Dataset
        from transformers import AutoTokenizer

        if sp is None:
            from trl import SFTConfig, SFTTrainer
        else:
            from accelerate_zero.integrations.trl import ZeroSFTConfig as SFTConfig
            from accelerate_zero.integrations.trl import ZeroSFTTrainer as SFTTrainer
        args = SFTConfig(**_trainer_kwargs(folder, sp, **overrides), bf16=False, max_length=None)  # TRL: bf16
        dataset = Dataset.from_list([{"input_ids": row["input_ids"].tolist()} for row in data])  # tokenized already
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=ListCollator(collator),
            processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
        )
    else:
        if sp is None:
            from transformers import Trainer, TrainingArguments
        else:
            from accelerate_zero import Trainer, TrainingArguments
        model.eval()  # as `from_pretrained` gives it: the Trainer reads batches before `training_step` trains it
        args = TrainingArguments(**_trainer_kwargs(folder, sp, **overrides))
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train(resume_from_checkpoint=resume)
    trainer.recorded = list(collator.seen)  # the training batches only (evaluation collates more)
    return trainer


def _logged(trainer: Any) -> list[dict[str, float]]:
    return [{k: v for k, v in log.items() if k in METRICS} for log in trainer.state.log_history if "loss" in log]


def _trainer(rank: int, world_size: int, sp: int, folder: str, trl: bool) -> dict[str, Any]:
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    data = _trainer_data(world_size)
    trainer = _train(folder, sp, trl, data)
    # evaluation runs whole sequences on every rank (not cut, not divided by sp): one sample repeated, so its loss
    # is the mean whatever the split
    dataset = trainer.train_dataset
    evaluated = trainer.evaluate(dataset.select([0] * 4) if trl else [data[0]] * 4)["eval_loss"]
    out = {
        "seen": trainer.recorded,
        "params": gathered(trainer.model),
        "logs": _logged(trainer),
        "sp": trainer.accelerator.sequence_parallel_size,
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "eval_loss": evaluated,
        "batch": trainer.zero_engine.config.train_batch_size,
    }
    alst = _train(f"{folder}/alst", sp, trl, data, sequence_parallel_loss_normalization="deepspeed_alst")
    out["alst_params"] = gathered(alst.model)
    out.update(_evaluated_over_cut_sequences(trainer, trl, data))
    # resumed inside the epoch: a checkpoint after the first of its 4 steps, then the 3 others from it
    _train(f"{folder}/resume", sp, trl, data, max_steps=1, save_strategy="steps", save_steps=1)
    resumed = _train(f"{folder}/resumed", sp, trl, data, resume=CHECKPOINT.format(folder=folder))
    out.update(resumed_params=gathered(resumed.model), resumed_logs=_logged(resumed))
    if not trl:
        out["refused"] = _refusals(_trainer_kwargs(folder, sp), data, RecordingCollator(), folder)
        out.update(_evaluated_before_training(_trainer_kwargs(f"{folder}/early", sp), data))
    return out


def _evaluation_set(trainer: Any, trl: bool, data: list) -> Any:
    """Samples of uneven lengths (6 to 13 tokens), each batch right-padded to its longest: 2 batches per rank at
    world size 2, 4 in one process."""
    return trainer.train_dataset.select(range(4 * MICRO)) if trl else data[: 4 * MICRO]


def _evaluated_over_cut_sequences(trainer: Any, trl: bool, data: list) -> dict[str, Any]:
    """`sequence_parallel_evaluation=True`: eval_loss and predictions, and whether the group exchanged the cut
    sequences for them (the Ulysses all-to-all, the logits gathered along the sequence)."""

    def calls(kind: str) -> int:
        return trainer.zero_engine.comm_stats().get(kind, {}).get("calls", 0)

    trainer.args.sequence_parallel_evaluation = True
    before = calls("all_to_all_sequence")
    evaluated = trainer.evaluate(_evaluation_set(trainer, trl, data))["eval_loss"]
    cut = calls("all_to_all_sequence") > before and calls("all_gather_sequence_logits") == 0
    predicted = trainer.predict(_evaluation_set(trainer, trl, data))
    trainer.args.sequence_parallel_evaluation = False
    return {
        "cut_eval_loss": evaluated,
        "cut_eval_traffic": cut and calls("all_gather_sequence_logits") > 0,
        "predictions": torch.as_tensor(predicted.predictions),  # numpy arrays do not pass between processes
        "label_ids": torch.as_tensor(predicted.label_ids),
    }


CHECKPOINT = "{folder}/resume/checkpoint-1"  # saved at sp 2 after the first of the epoch's 4 steps


def _one_process(rank: int, world_size: int, folder: str, trl: bool) -> dict[str, Any]:
    """transformers' Trainer (or TRL's SFTTrainer) itself, in one process, on the same batches in the same order;
    and ours at sp 1 resumed from the checkpoint the sp 2 run saved inside the epoch."""
    from tests.helpers.dist import plain_torchrun_environment

    plain_torchrun_environment()
    data = _trainer_data(2)
    trainer = _train(f"{folder}/one_process", None, trl, data)
    evaluated = trainer.evaluate(trainer.train_dataset.select([0] * 4) if trl else [data[0]] * 4)["eval_loss"]
    whole = _evaluation_set(trainer, trl, data)
    predicted = trainer.predict(whole)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    at_sp1 = _train(f"{folder}/resumed_sp1", 1, trl, data, resume=CHECKPOINT.format(folder=folder))
    early = {}
    if not trl:  # the untrained model evaluated and predicted whole by transformers' own Trainer
        from transformers import Trainer, TrainingArguments

        model = tiny_model()
        model.eval()
        args = TrainingArguments(**_trainer_kwargs(f"{folder}/early", None))
        fresh = Trainer(model=model, args=args, data_collator=RecordingCollator())
        early_predicted = fresh.predict(whole)
        early = {
            "early_eval_loss": fresh.evaluate(whole)["eval_loss"],
            "early_predictions": torch.as_tensor(early_predicted.predictions),
            "early_label_ids": torch.as_tensor(early_predicted.label_ids),
        }
    return {
        **early,
        "params": params,
        "logs": _logged(trainer),
        "seen": trainer.recorded,
        "eval_loss": evaluated,
        "uneven_eval_loss": trainer.evaluate(whole)["eval_loss"],
        "predictions": torch.as_tensor(predicted.predictions),  # numpy arrays do not pass between processes
        "label_ids": torch.as_tensor(predicted.label_ids),
        "sp1_resumed_params": gathered(at_sp1.model),
        "sp1_resumed_logs": _logged(at_sp1),
    }


def _alst_reference(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DeepSpeed ALST's rule in one process: each step averages its micro-batches' token means."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for start in range(0, len(batches), TRAINER_ACCUMULATION):
        step = batches[start : start + TRAINER_ACCUMULATION]
        torch.stack([model(**batch).loss for batch in step]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _refusals(kwargs: dict[str, Any], data: list, collator: RecordingCollator, folder: str) -> dict[str, str]:
    """What the Trainer refuses by name under sequence parallelism instead of doing it wrong: a loss other than the
    group's token mean, a normalisation no rule names, and `sequence_parallel_evaluation` without sp."""
    from accelerate_zero import Trainer, TrainingArguments

    def error_of(run: Any) -> str:
        try:
            run()
        except ValueError as error:
            return str(error)
        return "nothing raised"

    out = {}
    smoothing = Trainer(
        model=tiny_model(), args=TrainingArguments(**kwargs, label_smoothing_factor=0.1), train_dataset=data
    )
    out["smoothing"] = error_of(smoothing.get_train_dataloader)
    out["rule"] = error_of(lambda: TrainingArguments(**kwargs, sequence_parallel_loss_normalization="alst"))
    plain = {**kwargs, "parallelism_config": None, "sequence_parallel_loss_normalization": "deepspeed_alst"}
    out["rule_without_sp"] = error_of(
        Trainer(model=tiny_model(), args=TrainingArguments(**plain), train_dataset=data).get_train_dataloader
    )
    uncut = {
        **plain,
        "sequence_parallel_loss_normalization": "accumulated_tokens",
        "sequence_parallel_evaluation": True,
    }
    out["evaluation_without_sp"] = error_of(lambda: Trainer(model=tiny_model(), args=TrainingArguments(**uncut)))
    return out


def _evaluated_before_training(kwargs: dict[str, Any], data: list) -> dict[str, Any]:
    """`sequence_parallel_evaluation=True` before `train()`: evaluate() and predict() over cut sequences with the
    engine the model is prepared with for inference."""
    from accelerate_zero import Trainer, TrainingArguments

    model = tiny_model()
    model.eval()
    early = {**kwargs, "sequence_parallel_evaluation": True}
    untrained = Trainer(model=model, args=TrainingArguments(**early), data_collator=RecordingCollator())
    evaluated = untrained.evaluate(data[: 4 * MICRO])["eval_loss"]
    predicted = untrained.predict(data[: 4 * MICRO])
    engine = untrained.accelerator.prepared_model_of(untrained.model).engine
    return {
        "early_eval_loss": evaluated,
        "early_cut": engine.comm_stats().get("all_to_all_sequence", {}).get("calls", 0) > 0,
        "early_predictions": torch.as_tensor(predicted.predictions),
        "early_label_ids": torch.as_tensor(predicted.label_ids),
    }


def _error(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((params[n] - p).abs().max().item() for n, p in reference.items())


@pytest.mark.parametrize("trl", [pytest.param(False, id="Trainer"), pytest.param(True, id="SFTTrainer")])
def test_trainer_with_parallelism_config_matches_one_process(tmp_path, trl: bool) -> None:
    """sp 2 equals transformers' Trainer (TRL's SFTTrainer) in one process: weights, logged losses and TRL's
    metrics, with uneven lengths and accumulation 3 ([Note: loss normalisation under sequence parallelism]);
    `sequence_parallel_loss_normalization="deepspeed_alst"` trains on DeepSpeed ALST's rule instead."""
    world_size, sp = 2, 2
    results = run_distributed(_trainer, world_size, sp, str(tmp_path), trl)
    reference = run_distributed(_one_process, 1, str(tmp_path), trl)[0]
    moved = _error(tiny_model().state_dict(), reference["params"])
    for result in results:
        if not trl:
            refused = result["refused"]
            assert "label_smoothing_factor with sequence_parallel_size=2" in refused["smoothing"]
            assert "sequence_parallel_loss_normalization='alst': choose one of 'accumulated_tokens'" in refused["rule"]
            assert (
                "sequence_parallel_loss_normalization='deepspeed_alst' without sequence parallelism"
                in (refused["rule_without_sp"])
            ), "an opt-in that cannot act is refused, not ignored"
            assert "sequence_parallel_evaluation=True without sequence parallelism" in refused["evaluation_without_sp"]
            # evaluate() / predict() before train(): over cut sequences, as transformers' Trainer on whole ones
            assert result["early_cut"], "evaluation before training cut the sequences"
            assert result["early_eval_loss"] == pytest.approx(reference["early_eval_loss"], abs=1e-6)
            assert torch.equal(result["early_label_ids"], reference["early_label_ids"])
            real = reference["early_label_ids"] != -100
            early_error = (result["early_predictions"] - reference["early_predictions"])[real].abs().max().item()
            assert early_error <= 1e-5, "logits before training gathered whole"
        alst = _alst_reference(reference["seen"])
        assert _error(result["alst_params"], alst) <= 1e-6 * max(1.0, moved), "the opt-in trains on ALST's rule"
        assert _error(alst, reference["params"]) > 0.3 * moved, "the two rules differ on these batches (64%)"
        assert result["sp"] == sp and result["batch"] == MICRO * TRAINER_ACCUMULATION * world_size // sp
        assert result["global_step"] == TRAINER_STEPS and result["epoch"] == pytest.approx(1.0)
        assert result["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
        assert _error(result["params"], reference["params"]) <= 1e-6 * max(1.0, moved), "weights as one process"
        assert len(result["logs"]) == TRAINER_STEPS
        for ours, theirs in zip(result["logs"], reference["logs"], strict=True):
            assert ours.keys() == theirs.keys() and len(ours) == (4 if trl else 1), (ours, theirs)
            assert ours == pytest.approx(theirs, rel=1e-5), "logged loss (and TRL's metrics) as one process"
        # evaluation over cut sequences: eval_loss and predictions as one process evaluating whole sequences
        assert result["cut_eval_traffic"], "sequence_parallel_evaluation cut the sequences (and gathered the logits)"
        assert result["cut_eval_loss"] == pytest.approx(reference["uneven_eval_loss"], abs=1e-6), "not x or / sp"
        assert result["label_ids"].shape == reference["label_ids"].shape
        assert torch.equal(result["label_ids"], reference["label_ids"]), "labels gathered whole, in order"
        real = reference["label_ids"] != -100  # at padded positions the logits are nobody's prediction
        error = (result["predictions"] - reference["predictions"])[real].abs().max().item()
        assert result["predictions"].shape == reference["predictions"].shape and error <= 1e-5, "logits gathered whole"
        # resumed inside the epoch at sp 2, and at sp 1 from the checkpoint saved at sp 2: as the run never stopped
        assert _error(result["resumed_params"], reference["params"]) <= 1e-6 * max(1.0, moved)
        _same_logs(_resumed(result["resumed_logs"]), _resumed(result["logs"]))
    assert _error(reference["sp1_resumed_params"], reference["params"]) <= 1e-6 * max(1.0, moved)
    _same_logs(_resumed(reference["sp1_resumed_logs"]), _resumed(reference["logs"]))


def _same_logs(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> None:
    assert len(ours) == len(theirs) == TRAINER_STEPS - 1
    for mine, other in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(other, rel=1e-5)


def _resumed(logs: list[dict[str, float]]) -> list[dict[str, float]]:
    """The logs of the steps after the checkpoint (the resumed run's history holds the first step's from it), but
    TRL's `num_tokens`: TRL counts the tokens a process has seen, and a resumed process starts again from 0."""
    return [{k: v for k, v in log.items() if k != "num_tokens"} for log in logs[1:]]
