"""Stage 3 with every parameter sharded, calling sub-modules instead of the model: `model.model(...)` with a head of
the user's, `model.lm_head(...)` on its own, a layer's attention alone, and encoder-decoder `generate()` (which calls
`get_encoder()(...)`), each against a one-process reference. One spawned group of 2 ranks runs every check.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.models import tiny_bart_config, tiny_llama_config, tiny_t5_config


STEPS, GRAD_ACCUM, PER_RANK_BATCH, SEQ, VOCAB = 3, 2, 2, 10, 64
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
WORLD_SIZE = 2


def _llama(tied: bool, checkpointing: bool = False) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied))
    if checkpointing:  # the layers are recomputed inside backward, nested in no sub-module call
        model.gradient_checkpointing_enable({"use_reentrant": True})
    return model


def _batches() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shape = (PER_RANK_BATCH * WORLD_SIZE, SEQ)
    return [[torch.randint(0, VOCAB, shape, generator=gen) for _ in range(GRAD_ACCUM)] for _ in range(STEPS)]


def _head_loss(model: torch.nn.Module, tokens: torch.Tensor, head: str) -> torch.Tensor:
    """A reward-model style loss on `model.model(...)`: the LM head called on its own, or a head of the user's; or
    the model's own language-modelling loss ("model")."""
    if head == "model":
        return model(input_ids=tokens, labels=tokens).loss
    hidden = model.model(input_ids=tokens).last_hidden_state
    if head == "lm_head":
        return model.lm_head(hidden[:, -1]).logsumexp(-1).mean()
    weight = torch.linspace(-1.0, 1.0, hidden.shape[-1])
    return (hidden @ weight).sin().mean()


def _train(model: torch.nn.Module, step_fn: Any, batches: list, head: str) -> None:
    for step in batches:
        for tokens in step:
            step_fn(_head_loss(model, tokens, head))


def _reference(tied: bool, head: str, batches: list) -> torch.nn.Module:
    model = _llama(tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]

    def step_fn(loss: torch.Tensor) -> None:
        (loss / GRAD_ACCUM).backward()
        calls[0] += 1
        if calls[0] % GRAD_ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

    _train(model, step_fn, [[t for t in step] for step in batches], head)
    return model


def _max_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    import accelerate_zero

    with accelerate_zero.GatheredParameters(list(model.parameters())):
        return max(
            (p.detach() - r.detach()).abs().max().item()
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )


def _submodel_training(rank: int, tied: bool, head: str, checkpointing: bool = False) -> dict[str, Any]:
    import accelerate_zero

    batches = _batches()
    reference = _reference(tied, head, batches)
    model = _llama(tied, checkpointing)
    # max_reuse_distance 0: every unit is released right after its use, so "released" below is meaningful.
    zero = {**ZERO3, "stage3_max_reuse_distance": 0}
    config = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 1.0, "zero_optimization": zero}
    engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)

    def step_fn(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    mine = [[t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in step] for step in batches]
    _train(model, step_fn, mine, head)
    out = {"diff": _max_diff(model, reference), "released": all(u.state.value == "sharded" for u in engine.units)}
    # A module inside a unit called on its own (e.g. to probe a layer): its unit is gathered just for the call.
    attention = model.model.layers[1].self_attn
    hidden = torch.randn(1, 4, 32)
    position = model.model.rotary_emb(hidden, torch.arange(4)[None])
    with torch.no_grad():
        sharded = attention(hidden, position_embeddings=position, attention_mask=None)[0]
        expected = reference.model.layers[1].self_attn(hidden, position_embeddings=position, attention_mask=None)[0]
    out["attention_diff"] = (sharded - expected).abs().max().item()
    out["released_after_call"] = all(u.state.value == "sharded" for u in engine.units)
    # A call that raises leaves its unit marked in use (modules inside units skip always_call); once released (as
    # after an optimizer step) the next call must gather it again.
    mlp, mlp_reference = model.model.layers[0].mlp, reference.model.layers[0].mlp
    try:
        mlp(torch.randn(1, 4, 7))
    except RuntimeError:
        out["raised"] = True
    # ... and leaves no process-wide state behind: no recording torch function mode, no eager dynamo stance
    out["modes_after_error"] = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
    engine.scheduler.release_all()
    with torch.no_grad():
        out["after_error_diff"] = (mlp(hidden) - mlp_reference(hidden)).abs().max().item()
    engine.destroy()
    return out


def _embedding_units(rank: int, tied: bool) -> dict[str, Any]:
    """Trains through the model's own forward (default reuse distance): untied embeddings and LM head are units of
    their own ([Note: embeddings are units of their own]), and a later forward gathers every unit but the root
    ahead of its use; a tied weight stays in the root unit."""
    import accelerate_zero

    batches = _batches()
    reference = _reference(tied, "model", batches)
    model = _llama(tied)
    config = {"gradient_accumulation_steps": GRAD_ACCUM, "gradient_clipping": 1.0, "zero_optimization": ZERO3}
    engine = accelerate_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    forwards = []
    for step in batches:
        for tokens in step:
            mine = tokens[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH]
            before = (engine.scheduler.gathers_on_demand, engine.scheduler.gathers_prefetched)
            loss = _head_loss(model, mine, "model")
            forwards.append(
                (engine.scheduler.gathers_on_demand - before[0], engine.scheduler.gathers_prefetched - before[1])
            )
            engine.backward(loss)
            engine.step()
    out = {"diff": _max_diff(model, reference), "units": [u.name for u in engine.units], "forwards": forwards}
    engine.destroy()
    return out


def _encoder_decoder_generate(rank: int, kind: str) -> dict[str, Any]:
    from transformers import BartForConditionalGeneration, T5ForConditionalGeneration

    import accelerate_zero

    torch.manual_seed(0)
    if kind == "t5":
        model = T5ForConditionalGeneration(tiny_t5_config())
    else:
        model = BartForConditionalGeneration(tiny_bart_config())
    reference = copy.deepcopy(model).eval()
    engine = accelerate_zero.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config={"zero_optimization": ZERO3}
    )
    model.eval()
    gen = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(3, VOCAB, (1, 4 + 3 * rank), generator=gen)  # a different length on every rank
    length = 3 + 4 * rank  # ranks finish at different steps: the early ones keep stepping (synced_gpus)
    kwargs = {"max_new_tokens": length, "min_new_tokens": length, "do_sample": False, "num_beams": 1}
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=prompt).last_hidden_state
        expected_encoded = reference.get_encoder()(input_ids=prompt).last_hidden_state
        sharded = model.generate(prompt, **kwargs)
        expected = reference.generate(prompt, **kwargs)
    out = {
        "encoder_diff": (encoded - expected_encoded).abs().max().item(),
        "same": torch.equal(sharded, expected),
        "shape": tuple(sharded.shape),
        "expected_shape": tuple(expected.shape),
    }
    engine.destroy()
    return out


def _all_checks(rank: int, world_size: int) -> dict[str, Any]:
    assert world_size == WORLD_SIZE
    out: dict[str, Any] = {}
    for tied, head in ((True, "lm_head"), (False, "user")):
        out[f"train-{head}"] = _submodel_training(rank, tied, head)
    out["train-checkpointed"] = _submodel_training(rank, True, "lm_head", checkpointing=True)
    out["train-untied-lm_head"] = _submodel_training(rank, False, "lm_head")
    for tied in (True, False):
        out[f"embedding-units-{'tied' if tied else 'untied'}"] = _embedding_units(rank, tied)
    for kind in ("t5", "bart"):
        out[f"generate-{kind}"] = _encoder_decoder_generate(rank, kind)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    from tests.helpers.dist import run_distributed

    return run_distributed(_all_checks, WORLD_SIZE)


@pytest.mark.parametrize("head", ["lm_head", "user", "checkpointed"])
def test_training_through_model_model_matches_reference(results: Any, head: str) -> None:
    # fp32, SGD: only the summation order of the two half-batch gradients differs from the reference.
    for r in results:
        assert r[f"train-{head}"]["diff"] < 1e-6, r[f"train-{head}"]
        assert r[f"train-{head}"]["released"]


def test_module_inside_a_unit_called_alone(results: Any) -> None:
    for r in results:
        assert r["train-lm_head"]["attention_diff"] < 1e-6
        assert r["train-lm_head"]["released_after_call"]
        assert r["train-lm_head"]["raised"] and r["train-lm_head"]["after_error_diff"] < 1e-6
        assert r["train-lm_head"]["modes_after_error"] == []


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_generate_matches_unsharded(results: Any, kind: str) -> None:
    for r in results:
        g = r[f"generate-{kind}"]
        assert g["encoder_diff"] < 1e-6, g
        assert g["same"], g


def test_untied_embeddings_and_lm_head_are_units_prefetched_in_forward(results: list[dict[str, Any]]) -> None:
    layers = ["model.layers.0", "model.layers.1"]
    for r in results:
        untied, tied = r["embedding-units-untied"], r["embedding-units-tied"]
        assert untied["diff"] < 1e-6 and tied["diff"] < 1e-6, (untied["diff"], tied["diff"])
        assert untied["units"] == ["model.embed_tokens", *layers, "lm_head", ""]
        assert tied["units"] == [*layers, ""]  # the shared weight stays in the root unit
        # The first forward records the order (everything on demand); every later one gathers only the root (the
        # final norm) when it is needed and issues every other unit ahead of its use.
        assert untied["forwards"][0] == (5, 0)
        assert set(untied["forwards"][1:]) == {(1, 4)}, untied["forwards"]
        assert r["train-untied-lm_head"]["diff"] < 1e-6
