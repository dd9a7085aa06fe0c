"""Expert parallelism through the engine (issue 41): `expert_parallel: {enabled, autoep_size}` in the config, ZeRO
stages 1-3 on the rest, against one process on the full batch ([Note: expert parallelism in the engine] in
experts/partition.py).

One spawned group of 4 ranks trains a tiny Qwen3-MoE (grouped matmuls), a tiny Mixtral (eager experts) and a top-1
Mixtral whose every token goes to expert 0 (at ep 4 three ranks hold experts no token reaches) for 2 optimizer steps
of AdamW with gradient accumulation 2 and clipping that is active (max norm below the gradient norm), at ep 2 and 4
and stages 1, 2 and 3. Each rank's micro-batches are its quarter of the batch; the reference is one process on the
whole batch, the same AdamW and the same clipping. Compared: every step's mean loss, every dense parameter and
each rank's slice of every expert parameter after training (fp32, within 1e-5), and the gradient norm the engine
clipped with. A bf16 run at ep 2, stage 3 is compared against the same run without expert parallelism (both
round to bf16 differently from fp32: the bound is bf16's, 2e-2 relative).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_expert_parallel import _force_expert_zero, _model
from tests.helpers.moe_models import held_expert_share


WORLD_SIZE, MICRO, LENGTH, ACCUM, STEPS = 4, 1, 7, 2, 2
MAX_NORM, LR = 0.2, 1e-2
EPS = 1e-6  # a top-1 router's gradient is 0 up to rounding: AdamW's default eps (1e-8) would turn that rounding into steps
MODELS = ("qwen3_moe", "mixtral", "mixtral_top1_all_to_expert_zero")
CASES = [(kind, ep, stage) for kind in MODELS for ep in (2, 4) for stage in (1, 2, 3)]
OFFLOADED = [("qwen3_moe", 2, 3), ("mixtral", 4, 2)]
"""Cases also run with `offload_optimizer: cpu` (the experts' masters and states in host memory too)."""


def _batches(world: int = WORLD_SIZE) -> torch.Tensor:
    """[steps, accumulation, world, micro, length] token ids."""
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, 64, (STEPS, ACCUM, world, MICRO, LENGTH), generator=generator)


def _built(kind: str) -> torch.nn.Module:
    model = _model(kind)
    if kind == "mixtral_top1_all_to_expert_zero":
        _force_expert_zero(model, None)
    return model


def _reference(kind: str, world: int = WORLD_SIZE) -> dict[str, Any]:
    model = _built(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    losses, norms = [], []
    for step in _batches(world):
        total = 0.0
        for micro in step:
            tokens = micro.reshape(-1, LENGTH)
            loss = model(input_ids=tokens, labels=tokens).loss / ACCUM
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _engine_run(
    kind: str, ep: int, stage: int, rank: int, bf16: bool = False, offload: bool = False, world: int = WORLD_SIZE
) -> dict[str, Any]:
    import torch.distributed as dist

    import accelerate_zero

    model = _built(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": MAX_NORM,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "bf16": {"enabled": bf16},
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": model.config.model_type}
    engine = accelerate_zero.initialize(model, optimizer, config=config)
    losses, norms = [], []
    for step in _batches(world):
        total = torch.zeros(())
        for micro in step:
            tokens = micro[rank]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / ACCUM
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.get_global_grad_norm())
    params = {n: t.detach().float().clone() for n, t in engine.full_state_dict().items()} if stage == 3 else None
    streamed = {n: t.float() for n, t in engine.named_full_parameters(max_bytes=1)}  # one unit at a time
    stream_error = max(((streamed[n] - v).abs().max().item() for n, v in params.items() if n in streamed),
                       default=0.0) if params else 0.0  # fmt: skip
    if params:
        assert set(streamed) == {n for n, _ in model.named_parameters()}, sorted(set(streamed) ^ set(params))
    local = {n: p.detach().float().clone() for n, p in model.named_parameters()} if stage < 3 else None
    ranges = engine.experts.ranges if engine.experts is not None else {}
    held = held_expert_share(engine) if engine.experts is not None else None
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "local": local, "ranges": ranges, "stream": stream_error,
            "bytes": engine.comm_stats_counter.as_dict(), "held": held}  # fmt: skip


def _errors(got: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    errors = {}
    if got["params"] is not None:  # stage 3: full_state_dict gathers every expert, whole on rank 0 ({} elsewhere)
        if not got["params"]:
            return {"full_state_dict is rank 0's": 0.0}
        for name, value in got["params"].items():
            errors[name] = (value - reference["params"][name]).abs().max().item()
        return errors
    for name, value in got["local"].items():
        expected = reference["params"][name]
        layer = name.rsplit(".", 1)[0]
        if layer in got["ranges"]:
            start, stop = got["ranges"][layer]
            expected = expected[start:stop]
        errors[name] = (value - expected).abs().max().item()
    return errors


def _all(rank: int, world_size: int) -> dict[Any, Any]:
    references = {kind: _reference(kind) for kind in MODELS}
    out: dict[Any, Any] = {}
    for kind, ep, stage, offload in [*((*case, False) for case in CASES), *((*case, True) for case in OFFLOADED)]:
        got = _engine_run(kind, ep, stage, rank, offload=offload)
        reference = references[kind]
        out[(kind, ep, stage, offload)] = {
            "loss": max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)),
            "norm": max(abs(a - b) for a, b in zip(got["norms"], reference["norms"], strict=True)),
            "clipped": min(reference["norms"]) > MAX_NORM,
            "errors": _errors(got, reference),
            "stream": got["stream"],
            "held": got["held"],
            "moved": max(abs(v - reference["params"][n]).max().item() for n, v in _model_after_init(kind).items()),
        }
    with_experts, without = (
        _engine_run("qwen3_moe", 2, 3, rank, bf16=True),
        _engine_run("qwen3_moe", 1, 3, rank, bf16=True),
    )
    out["bf16"] = {
        "loss": max(abs(a - b) for a, b in zip(with_experts["losses"], without["losses"], strict=True)),
        "errors": _errors(with_experts, {"params": without["params"] or {}})
        if rank == 0
        else {"rank 0 compares": 0.0},
        "fp32_gap": max(abs(a - b) for a, b in zip(without["losses"], references["qwen3_moe"]["losses"], strict=True)),
    }
    return out


def _odd_world(rank: int, world_size: int) -> dict[Any, Any]:
    """3 ranks, ep 3 (six experts, two per rank; the dense shards padded to 3): stages 2 and 3 as above."""
    reference = _reference("qwen3_moe_six", world_size)
    out = {}
    for stage in (2, 3):
        got = _engine_run("qwen3_moe_six", 3, stage, rank, world=world_size)
        out[stage] = {
            "loss": max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)),
            "norm": max(abs(a - b) for a, b in zip(got["norms"], reference["norms"], strict=True)),
            "worst": max(_errors(got, reference).items(), key=lambda item: item[1]),
            "held": got["held"],
        }
    return out


@pytest.fixture(scope="module")
def odd_world() -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_odd_world, 3)


def test_expert_parallel_on_an_odd_world_equals_one_process(odd_world: list[dict[Any, Any]]) -> None:
    for results in odd_world:
        for stage, got in results.items():
            assert got["loss"] < 1e-5 and got["norm"] < 1e-5 and got["worst"][1] < 1e-5, (stage, got)
            assert got["held"] == pytest.approx(1 / 3), (stage, got)  # ep = W: each rank alone holds its two


def _model_after_init(kind: str) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in _built(kind).named_parameters()}


@pytest.fixture(scope="module")
def by_rank() -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all, WORLD_SIZE, timeout=600)


@pytest.mark.parametrize(
    ("kind", "ep", "stage", "offload"), [*((*c, False) for c in CASES), *((*c, True) for c in OFFLOADED)]
)
def test_expert_parallel_engine_equals_one_process(
    by_rank: list[dict[Any, Any]], kind: str, ep: int, stage: int, offload: bool
) -> None:
    for rank, results in enumerate(by_rank):
        got = results[(kind, ep, stage, offload)]
        assert got["clipped"] and got["moved"] > 1e-3, got  # clipping acts, and training moves the weights
        assert got["loss"] < 1e-5, (rank, got["loss"])
        assert got["norm"] < 1e-5, (rank, got["norm"])
        worst = max(got["errors"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-5, (rank, worst)
        assert got["stream"] == 0.0, got["stream"]  # the weight stream hands over whole experts
        assert got["held"] == pytest.approx(1 / WORLD_SIZE if stage == 3 else 1 / ep), got  # stage 3: 1/W, as flat


# ------------------------------------------------------------------------------------------------- checkpoints
# Saved at ep 2 (stage 3 and stage 2) after one step; loaded at ep 4, at ep 1 (no expert parallelism: every rank
# holds every expert) and at ep 2 on another stage, each then trained one more step: the loss and the whole weights
# equal the run that never stopped. The checkpoint also consolidates into a folder `from_pretrained` loads (its
# weights equal the engine's whole weights at the save).
RESUMES = [(2, 3, 4, 3), (2, 3, 1, 3), (2, 3, 2, 1), (2, 2, 4, 2), (2, 2, 1, 1)]
"""(ep, stage) saved -> (ep, stage) resumed."""
DCP_RESUMES = [(2, 3, 4, 2), (2, 3, 1, 3)]
"""The same through `checkpoint_format="dcp"` (each split expert at its range of the whole layer)."""


def _config(ep: int, stage: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": MAX_NORM,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
    }
    if stage == 3:  # else the tiny experts are persistent ([Note: experts below 1/ep at stage 3])
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return config


def _train_step(engine: Any, step: torch.Tensor, rank: int) -> float:
    import torch.distributed as dist

    total = torch.zeros(())
    for micro in step:
        loss = engine(input_ids=micro[rank], labels=micro[rank]).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach() / ACCUM
    dist.all_reduce(total)
    return total.item() / WORLD_SIZE


def _whole(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.float().clone() for n, t in engine.full_state_dict().items()}


def _resume(rank: int, world_size: int, folder: str) -> dict[Any, Any]:
    import accelerate_zero
    from accelerate_zero.checkpoint.consolidate import consolidate

    batches = _batches()
    out: dict[Any, Any] = {}
    for save_ep, save_stage in sorted({(e, s) for e, s, _, _ in RESUMES}):
        model = _built("qwen3_moe")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
        engine = accelerate_zero.initialize(model, optimizer, config=_config(save_ep, save_stage))
        _train_step(engine, batches[0], rank)
        saved = engine.save_checkpoint(f"{folder}/ep{save_ep}s{save_stage}")
        if any((e, s) == (save_ep, save_stage) for e, s, _, _ in DCP_RESUMES):
            engine.save_checkpoint(f"{folder}/dcp", tag=f"ep{save_ep}s{save_stage}", checkpoint_format="dcp")
        at_save = _whole(engine)
        consolidated = {}
        if rank == 0:  # `accelerate-zero consolidate`'s folder, loaded by from_pretrained
            out_dir = consolidate(saved, f"{folder}/hf_ep{save_ep}s{save_stage}")
            model.config.save_pretrained(out_dir)
            loaded = type(model).from_pretrained(out_dir)
            consolidated = {n: p.detach() for n, p in loaded.named_parameters()}
        final_loss = _train_step(engine, batches[1], rank)
        final = _whole(engine)
        engine.destroy()
        out[("consolidated", save_ep, save_stage)] = max(
            ((consolidated[n] - v).abs().max().item() for n, v in at_save.items()), default=0.0
        ) if rank == 0 else 0.0  # fmt: skip
        resumes = [("universal", *case) for case in RESUMES] + [("dcp", *case) for case in DCP_RESUMES]
        for kind, ep, stage, load_ep, load_stage in resumes:
            if (ep, stage) != (save_ep, save_stage):
                continue
            model = _built("qwen3_moe")
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
            engine = accelerate_zero.initialize(model, optimizer, config=_config(load_ep, load_stage))
            dcp, where = kind == "dcp", f"ep{save_ep}s{save_stage}"
            engine.load_checkpoint(f"{folder}/dcp" if dcp else f"{folder}/{where}", tag=where if dcp else None)
            loss = _train_step(engine, batches[1], rank)
            resumed = _whole(engine)
            engine.destroy()
            errors = [(n, (resumed[n] - v).abs().max().item()) for n, v in final.items()] if rank == 0 else []
            out[(kind, ep, stage, load_ep, load_stage)] = {
                "loss": abs(loss - final_loss),
                "worst": max(errors, key=lambda item: item[1], default=("(rank 0 compares)", 0.0)),
            }
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_resume, WORLD_SIZE, str(tmp_path_factory.mktemp("ep_ckpt")), timeout=600)


@pytest.mark.parametrize(
    ("kind", "ep", "stage", "load_ep", "load_stage"),
    [("universal", *case) for case in RESUMES] + [("dcp", *case) for case in DCP_RESUMES],
)
def test_checkpoint_resumes_at_another_expert_parallel_size(
    resumed: list[dict[Any, Any]], kind: str, ep: int, stage: int, load_ep: int, load_stage: int
) -> None:
    for results in resumed:
        got = results[(kind, ep, stage, load_ep, load_stage)]
        assert got["loss"] < 1e-5, got
        assert got["worst"][1] < 1e-5, got
    assert resumed[0][("consolidated", ep, stage)] < 1e-6


# ------------------------------------------------------------------------------------------------------ refusals
def _refusals(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import accelerate_zero
    from tests.integration import trainer_checks as checks

    def error_of(build: Any) -> str:
        try:
            build()
        except (ValueError, NotImplementedError) as error:
            return str(error)
        return "no error"

    config = _config(2, 3)

    def initialized(model: torch.nn.Module, **expert: Any) -> Any:
        settings = {**config, "expert_parallel": {**config["expert_parallel"], **expert}}
        return accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=settings)

    # generate() at stage 2 with every rank stopping at its own length: the ranks that are done keep stepping (each
    # forward is an all-to-all of the expert group), and each rank's tokens equal the unsplit model's
    reference = _built("qwen3_moe")
    prompt = _batches()[0, 0, rank]
    expected = reference.generate(input_ids=prompt, max_new_tokens=2 + rank, do_sample=False, pad_token_id=0)
    model = _built("qwen3_moe")
    settings = {**_config(2, 2)}
    generator = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=settings)
    with torch.no_grad():
        generated = generator.module.generate(
            input_ids=prompt, max_new_tokens=2 + rank, do_sample=False, pad_token_id=0
        )
    meta = generator.meta_state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape  # what other ranks see
    generator.destroy()
    # the same through peft (PeftModel.generate runs its base model's generate, which must know to stay in step)
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(_built("qwen3_moe"), LoraConfig(r=2, target_modules=["q_proj"]))  # B = 0: same tokens
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    engine = accelerate_zero.initialize(wrapped, torch.optim.SGD(trainable, lr=0.1), config=settings)
    with torch.no_grad():
        through_peft = wrapped.generate(input_ids=prompt, max_new_tokens=2 + rank, do_sample=False, pad_token_id=0)
    engine.destroy()
    return {
        "peft_generated": torch.equal(through_peft, expected),
        "meta_shape": list(meta),
        "generated": torch.equal(generated, expected) and generated.shape[1] == LENGTH + 2 + rank,
        "preset": error_of(lambda: initialized(_built("qwen3_moe"), preset_model="mixtral")),
        "modifier": error_of(lambda: _write_experts_from_rank_0(initialized(_built("qwen3_moe")))),
        "dense": error_of(lambda: initialized(checks.tiny_llama())),
    }


def _write_experts_from_rank_0(engine: Any) -> None:
    import accelerate_zero

    try:
        with accelerate_zero.GatheredParameters(engine.module.model.layers[0].mlp.experts.down_proj, modifier_rank=0):
            pass
    finally:
        engine.destroy()


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_refusals, WORLD_SIZE, str(tmp_path_factory.mktemp("ep_refused")))


def test_what_expert_parallelism_cannot_do_is_refused_by_name_and_generate_keeps_ranks_in_step(
    refused: list[dict[str, Any]],
) -> None:
    for errors in refused:
        assert "preset_model='mixtral' but the model is a 'qwen3_moe'" in errors["preset"], errors
        assert "modifier_rank=...) on model.layers.0.mlp.experts.down_proj" in errors["modifier"], errors
        assert "no fused experts module" in errors["dense"], errors
        assert errors["generated"] is True and errors["peft_generated"] is True, errors
        assert errors["meta_shape"] == [4, 48, 32], errors  # the whole layer's experts, as the main rank's state dict


def test_bf16_with_expert_parallel_equals_bf16_without(by_rank: list[dict[Any, Any]]) -> None:
    """The same bf16 run with and without expert parallelism: the differences stay at bf16's rounding (the losses
    agree far closer than either agrees with fp32)."""
    for results in by_rank:
        got = results["bf16"]
        assert got["loss"] < 5e-3 and got["fp32_gap"] > 0, got
        worst = max(got["errors"].items(), key=lambda item: item[1])
        assert worst[1] < 2e-2, worst  # two bf16 ulps of a weight below 2 in magnitude (0.0078 each)


# --------------------------------------------------------------------------------------------- frozen experts
# Adapters on a frozen MoE base (and GRPO/DPO's reference models): the split experts are frozen. Trained at ep 2,
# stage 3, saved without them (their fingerprints checked on load) and with them; each loaded at another ep and stage
# and trained on: equal to the run that never stopped. A model whose experts differ is refused, naming the expert.
FROZEN_RESUMES = (("without", 4, 3), ("with", 1, 2), ("with", 4, 1), ("dcp", 4, 3), ("dcp", 1, 2))  # saved at ep 2


def _frozen_experts_model() -> torch.nn.Module:
    model = _built("qwen3_moe")
    for name, param in model.named_parameters():
        param.requires_grad_(".experts." not in name)
    return model


def _frozen(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import accelerate_zero

    def engine_for(ep: int, stage: int, model: torch.nn.Module | None = None) -> Any:
        model = model if model is not None else _frozen_experts_model()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.01, eps=EPS)
        return accelerate_zero.initialize(model, optimizer, config=_config(ep, stage))

    batches = _batches()
    engine = engine_for(2, 3)
    _train_step(engine, batches[0], rank)
    engine.save_checkpoint(f"{folder}/without", tag="t")
    engine.save_checkpoint(f"{folder}/with", tag="t", exclude_frozen_parameters=False)
    engine.save_checkpoint(f"{folder}/dcp", tag="t", checkpoint_format="dcp")  # the frozen experts at their ranges
    final_loss = _train_step(engine, batches[1], rank)
    final = _whole(engine)
    engine.destroy()
    out: dict[str, Any] = {}
    for saved, ep, stage in FROZEN_RESUMES:
        engine = engine_for(ep, stage)
        engine.load_checkpoint(f"{folder}/{saved}", tag="t")
        loss = _train_step(engine, batches[1], rank)
        resumed = _whole(engine)
        engine.destroy()
        errors = [(n, (resumed[n] - v).abs().max().item()) for n, v in final.items()] if rank == 0 else []
        out[(saved, ep, stage)] = (abs(loss - final_loss), max(errors, key=lambda item: item[1], default=("-", 0.0)))
    other = _frozen_experts_model()
    with torch.no_grad():
        other.model.layers[1].mlp.experts.down_proj.add_(0.01)
    engine = engine_for(4, 3, other)
    try:
        engine.load_checkpoint(f"{folder}/without", tag="t")
        out["other base"] = "loaded"
    except ValueError as error:
        out["other base"] = str(error)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_frozen, WORLD_SIZE, str(tmp_path_factory.mktemp("ep_frozen")), timeout=600)


def test_frozen_split_experts_save_and_resume_at_another_expert_parallel_size(frozen: list[dict[str, Any]]) -> None:
    for results in frozen:
        for key in FROZEN_RESUMES:
            loss, worst = results[key]
            assert loss < 1e-5 and worst[1] < 1e-5, (key, loss, worst)
        assert "model.layers.1.mlp.experts.down_proj" in results["other base"], results["other base"]
