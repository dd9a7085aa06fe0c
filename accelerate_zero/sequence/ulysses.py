"""Ulysses sequence parallelism: attention over the whole sequence while each rank holds a slice of it.

[Note: Ulysses attention]
The ranks of a sequence-parallel group of size p each hold a consecutive slice of every sequence (s/p tokens) and
run the model on it; only attention needs the other tokens. Before attention one all-to-all trades sequence for
heads: each rank sends head group j (h/p consecutive heads) of its slice to rank j and receives that head group
for every slice, so it holds h/p heads over the whole sequence (slices in rank order, which is sequence order). It
attends (causal over the whole sequence) and a second all-to-all trades back. In backward the two exchanges run in
reverse. Key/value heads: with k heads divisible by p each rank gets its query heads' own k/p key/value heads (head
group j of the queries uses key/value group j); with fewer (GQA, k < p) they are repeated to the h query heads
first. RoPE is applied before attention from each rank's own position ids (`shard_sequence` gives them), so the
rotation is the whole sequence's.

The attention function is registered with transformers' `AttentionInterface` under a name bound to one group
(`register_ulysses_attention`), and a model uses it by `model.set_attn_implementation(name)`: nothing of
transformers is patched. While the model trains, the sequence is taken as one causal sequence (padding only at its
end, which attends to nothing before it that matters: its labels are -100). The mask transformers builds from a
slice's own length means nothing then and is not read: padding masks never reach the model (the loader drops them
after checking that padding is only at the end, and `sequence_parallel_loss` refuses them); soft-capping and sliding
windows shorter than the sequence are refused by name. While it does not train (evaluation, generation) each rank holds
whole sequences (sequence/loader.py passes them uncut) and the function is transformers' SDPA attention, with
SDPA's mask function registered under the same name, as DeepSpeed's `disable_in_eval` does. Whatever cuts sequences
(the loader, `sequence_parallel_loss`) checks that the model trains.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup


def _exchange(x: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """Row i of `x` (first dimension p) to rank i of `group`; row j of the result from rank j."""
    x = x.contiguous()  # before `empty_like`, which would copy a permuted view's strides
    received = torch.empty_like(x)
    collectives.all_to_all(received, x, group, stats, kind="all_to_all_sequence")
    return received


def _seq_to_heads(x: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """[b, h, s/p, d] on each rank -> [b, h/p, s, d]."""
    p = group.world_size
    b, h, s, d = x.shape
    rows = x.reshape(b, p, h // p, s, d).permute(1, 0, 2, 3, 4)  # row j: head group j
    received = _exchange(rows, group, stats)  # row i: rank i's slice of my head group
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _heads_to_seq(x: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """[b, h/p, s, d] on each rank -> [b, h, s/p, d] (the inverse of `_seq_to_heads`)."""
    p = group.world_size
    b, heads, s, d = x.shape
    rows = x.reshape(b, heads, p, s // p, d).permute(2, 0, 1, 3, 4)  # row j: slice j of my head group
    received = _exchange(rows, group, stats)  # row i: head group i of my slice
    return received.permute(1, 0, 2, 3, 4).reshape(b, p * heads, s // p, d)


class _Trade(torch.autograd.Function):
    """One exchange (`to_heads`: sequence for heads, else back); its backward is the other one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: DataParallelGroup, stats: CommStats, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.stats, ctx.to_heads = group, stats, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group, ctx.stats), None, None, None


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[b, k, s, d] -> [b, k * times, s, d], each head repeated in place (transformers' `repeat_kv` order)."""
    if times == 1:
        return x
    b, k, s, d = x.shape
    return x[:, :, None].expand(b, k, times, s, d).reshape(b, k * times, s, d)


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None, causal: bool
) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, scale=scaling, is_causal=causal
    )


# [Note: packed rows under Ulysses]
# A packed row holds several sequences, its position ids restarting at 0 for each (TRL's packing and padding-free
# collators, transformers' `DataCollatorWithFlattening`); a token must attend only within its own sequence. After
# the exchange each rank holds its heads over the whole row, so the bounds over the whole row are what it needs:
# the loader computes them once per batch from the whole rows' positions (sequence/loader.py) and hands them to the
# model as the keyword argument `ulysses_sequences`, which transformers passes down to the attention function
# (as it passes flash attention's `cu_seq_lens_q`). Each sequence then runs its own causal SDPA, and the rows are
# put back together: no (s x s) mask is built. RoPE already rotated each token by its position within its sequence.
def ulysses_attention_for(group: DataParallelGroup, stats: CommStats) -> Any:
    """An attention function with transformers' `AttentionInterface` signature, over `group`
    ([Note: Ulysses attention])."""

    def ulysses_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if not module.training:  # whole sequences on every rank ([Note: Ulysses attention])
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        p, heads, kv_heads = group.world_size, query.shape[1], key.shape[1]
        length = query.shape[2] * p
        # A sliding window at least as long as the sequence cuts nothing (Mistral's default of 4096 below 4096 tokens).
        window = kwargs.get("sliding_window")
        unsupported = {"sliding_window": window} if window is not None and window < length else {}
        if kwargs.get("softcap") is not None:
            unsupported["softcap"] = kwargs["softcap"]
        if unsupported:
            raise ValueError(
                f"Ulysses sequence parallelism runs causal attention over one whole sequence of {length} tokens; got "
                f"{unsupported}: pack sequences without padding masks, and use no soft-capping and no sliding window "
                "shorter than the sequence"
            )
        if heads % p:
            raise ValueError(f"{heads} attention heads cannot be split over {p} sequence-parallel ranks")
        if kv_heads % p:  # fewer key/value heads than ranks: every query head gets its own copy
            key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
        query, key, value = (_Trade.apply(x, group, stats, True) for x in (query, key, value))
        groups = query.shape[1] // key.shape[1]
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
        causal = getattr(module, "is_causal", True)
        sequences = kwargs.get("ulysses_sequences")
        if sequences is None:
            out = _sdpa(query, key, value, dropout, scaling, causal)
        else:  # [Note: packed rows under Ulysses]
            out = torch.cat(
                [
                    torch.cat(
                        [
                            _sdpa(*(x[i : i + 1, :, a:e] for x in (query, key, value)), dropout, scaling, causal)
                            for a, e in row
                        ],
                        dim=2,
                    )
                    for i, row in enumerate(sequences)
                ]
            )
        return _Trade.apply(out, group, stats, False).transpose(1, 2).contiguous(), None

    return ulysses_attention


def register_ulysses_attention(group: DataParallelGroup, stats: CommStats | None = None) -> str:
    """Registers Ulysses attention over `group` with transformers; returns the name to pass to
    `model.set_attn_implementation(name)`. The name is the group's: registering again replaces the function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = f"accelerate_zero_ulysses_{group.world_size}_{id(group.group)}"
    AttentionInterface.register(name, ulysses_attention_for(group, stats if stats is not None else CommStats()))
    AttentionMaskInterface.register(name, sdpa_mask)  # used while the model does not train
    return name
