"""Which sub-modules get a stage 3 entry hook, and which units it gathers ([Note: sub-module calls])."""

from __future__ import annotations

import sys

import torch

from accelerate_zero.engine.stage3.flat_unit import build_flat
from accelerate_zero.engine.stage3.hooks import entry_units
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.units import find_unit_modules, layout_units
from tests.helpers.models import tiny_llama_config


def _entries(tied: bool) -> dict[str, list[str]]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied))
    layout = layout_units(model, find_unit_modules(model), 0, sys.maxsize)
    units = [
        ParamUnit(
            i, spec.name, spec.module, build_flat(spec.trainable, 0, 1, torch.float32, torch.device("cpu")), None, None
        )
        for i, spec in enumerate(layout.units)
    ]
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(m)]: [u.name or "<root>" for u in needed] for m, needed in entry_units(model, units)}


def test_root_parameters_are_gathered_by_the_modules_owning_them() -> None:
    entries = _entries(tied=False)
    for name in ("model", "model.norm"):
        assert entries[name] == ["<root>"], (name, entries.get(name))
    # untied embeddings and LM head are units of their own: their unit hooks gather them
    assert "model.embed_tokens" not in entries and "lm_head" not in entries
    tied = _entries(tied=True)
    for name in ("model", "model.embed_tokens", "model.norm", "lm_head"):
        assert tied[name] == ["<root>"], (name, tied.get(name))


def test_a_tied_head_needs_the_root_unit_too() -> None:
    assert _entries(tied=True)["lm_head"] == ["<root>"]


def test_modules_inside_a_unit_gather_that_unit_and_unit_modules_need_no_entry() -> None:
    entries = _entries(tied=False)
    assert entries["model.layers.1.self_attn"] == ["model.layers.1"]
    assert entries["model.layers.0.mlp.down_proj"] == ["model.layers.0"]
    # a unit module gathers itself (unit hooks); the model's forward gathers the root unit
    assert "model.layers.0" not in entries and "" not in entries
    # modules without parameters (the rotary embedding) need nothing
    assert "model.rotary_emb" not in entries
