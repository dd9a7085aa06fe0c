"""Block-quantized collectives (ZeRO++ qwZ and qgZ): int8 weight all-gathers, int4 two-level gradient reduce-scatter.

[Note: block quantization and its error]
A tensor is cut into blocks of `block` elements; each block keeps one fp32 scale, its largest magnitude divided
by the largest code (127 for int8, 7 for int4), and each element the nearest code (symmetric, round to nearest).
Dequantized, an element is off by at most half a step: |x - x̂| <= max|block| / (2 * 127) for int8 and
max|block| / 14 for int4, and a block of zeros comes back exact. int4 codes are stored two per byte.

[Note: qwZ, the quantized weight all-gather]
Each rank quantizes its shard (int8) and the codes and scales are all-gathered instead of the values: a quarter of
the bytes of fp32 weights, half of bf16, plus 4 bytes per block. Every rank dequantizes every slice, its own
included, so all ranks compute with the same weights. Only the gathers the stage-3 scheduler issues for forward and
backward are quantized; `GatheredParameters`, saving and streaming weights read exact values. The fp32 masters and
the optimizer are untouched: the error is in the weights a forward uses, bounded per element as above.

[Note: qgZ, the quantized two-level reduce-scatter]
Gradients are reduced in two all-to-alls over a (node x local index) grid of k nodes of n ranks, world rank
r = node * n + j owning chunk r of the W = k * n chunks:
1. inside each node: rank (a, j) sends local rank j' the chunks j', n + j', 2n + j', ... of its gradient (int4);
   each rank dequantizes what it received and sums it in fp32: the node's partial sum of the k chunks owned by
   local index j across the nodes;
2. across nodes, among the ranks of local index j: the partial sum of chunk b * n + j goes to node b (int4), which
   dequantizes and sums the k partial sums in fp32 into its chunk.
Only step 2 crosses nodes: 1/n of the gradient per rank, in int4, an eighth of fp32's bytes. Each element's error
is at most half a step of every block it passed through: the n int4 blocks of step 1 and the k of step 2
(`two_level_error_bound` computes it for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats, Pending
from accelerate_zero.engine.groups import DataParallelGroup


_LEVELS = {8: 127, 4: 7}


@dataclass(frozen=True)
class BlockQuantization:
    """How values are quantized on the wire ([Note: block quantization and its error])."""

    bits: int
    """8 (weights) or 4 (gradients)."""
    block: int = 256
    """Elements per fp32 scale."""

    def __post_init__(self) -> None:
        if self.bits not in _LEVELS or self.block < 2 or self.block % 2:
            raise ValueError(f"block quantization needs 8 or 4 bits and an even block, got {self}")

    def padded(self, numel: int) -> int:
        return -(-numel // self.block) * self.block

    def code_bytes(self, numel: int) -> int:
        return self.padded(numel) * self.bits // 8

    def num_scales(self, numel: int) -> int:
        return self.padded(numel) // self.block


WEIGHTS = BlockQuantization(8, block=256)
"""qwZ's quantization: int8 keeps an element within 1/254 of its block's largest."""
GRADIENTS = BlockQuantization(4, block=64)
"""qgZ's: int4 is coarse (within 1/14 of the block's largest), so its blocks are small. With blocks of 256 small
gradients round to 0 beside a block's largest and the SFT recipe's loss curve fell behind flat stage 3's by up to
0.31 (more than another data seed moves it, 0.26); with 64, 0.06 (bench/README.md, "Bytes between nodes")."""


def quantize(values: torch.Tensor, q: BlockQuantization) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D `values` -> (uint8 codes, fp32 scales per block)."""
    levels = _LEVELS[q.bits]
    padded = torch.zeros(q.padded(values.numel()), dtype=torch.float32, device=values.device)
    padded[: values.numel()] = values
    blocks = padded.view(-1, q.block)
    scales = blocks.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int16) + levels
    codes = codes.to(torch.uint8).view(-1)
    if q.bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, q: BlockQuantization) -> torch.Tensor:
    """The fp32 values `quantize` encoded (the first `numel`)."""
    levels = _LEVELS[q.bits]
    if q.bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)
    values = (codes.to(torch.float32) - levels).view(-1, q.block) * scales[:, None]
    return values.view(-1)[:numel]


def error_bound(values: torch.Tensor, q: BlockQuantization) -> torch.Tensor:
    """Per element, half a quantization step of its block: the most `dequantize(quantize(v))` can be off."""
    padded = torch.zeros(q.padded(values.numel()), dtype=torch.float32, device=values.device)
    padded[: values.numel()] = values.abs()
    half_step = padded.view(-1, q.block).amax(dim=1) / (2 * _LEVELS[q.bits])
    return half_step.repeat_interleave(q.block)[: values.numel()]


# ----------------------------------------------------------------------------------------------------- qwZ
def quantized_all_gather(
    output: torch.Tensor, input: torch.Tensor, dp: DataParallelGroup, stats: CommStats, q: BlockQuantization
) -> Pending:
    """[Note: qwZ, the quantized weight all-gather]: every rank's `input` quantized, gathered and dequantized into
    `output` (W slices of `input.numel()`); `wait()` completes `output`."""
    world, numel = dp.world_size, input.numel()
    codes, scales = quantize(input.detach(), q)
    all_codes = torch.empty(world * codes.numel(), dtype=codes.dtype, device=codes.device)
    all_scales = torch.empty(world * scales.numel(), dtype=scales.dtype, device=scales.device)
    gathers = [
        collectives.all_gather(all_codes, codes, dp, stats, async_op=True, kind="all_gather_int8"),
        collectives.all_gather(all_scales, scales, dp, stats, async_op=True, kind="all_gather_scales"),
    ]

    def finish() -> None:
        for pending in gathers:
            pending.wait()
        rows = output.view(world, numel)
        for rank, (row_codes, row_scales) in enumerate(
            zip(all_codes.view(world, -1), all_scales.view(world, -1), strict=True)
        ):
            rows[rank].copy_(dequantize(row_codes, row_scales, numel, q))

    return Pending(None, finish)


# ----------------------------------------------------------------------------------------------------- qgZ
@dataclass(frozen=True, eq=False)
class TwoLevelGroups:
    """The groups of [Note: qgZ, the quantized two-level reduce-scatter]."""

    node: DataParallelGroup
    """The n ranks of this rank's node (group rank = local index j)."""
    across: DataParallelGroup
    """The k ranks of local index j, one per node (group rank = node index)."""


def quantized_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, groups: TwoLevelGroups, stats: CommStats, q: BlockQuantization
) -> None:
    """Sums `input` over every rank (k * n) and leaves this rank's chunk in `output` (synchronous)."""
    n, k = groups.node.world_size, groups.across.world_size
    chunk = output.numel()
    assert input.numel() == chunk * n * k, "quantized_reduce_scatter: the input is W chunks of the output's size"
    # Row j' = the chunks of local index j' over the k nodes: what local rank j' sums for its column.
    by_local = input.detach().float().view(k, n, chunk).transpose(0, 1)
    node_sum = _exchange_and_sum(by_local.reshape(n, k * chunk), groups.node, stats, q, "all_to_all_int4_node")
    across = _exchange_and_sum(node_sum.view(k, chunk), groups.across, stats, q, "all_to_all_int4_across")
    output.copy_(across)


def _exchange_and_sum(
    rows: torch.Tensor, group: DataParallelGroup, stats: CommStats, q: BlockQuantization, kind: str
) -> torch.Tensor:
    """Row i of `rows` goes to group rank i (quantized); returns the fp32 sum of the rows received from every rank
    (this rank's own row, not sent, is quantized too: every contribution carries the same error)."""
    size, width = rows.shape
    encoded = [quantize(row, q) for row in rows]
    codes = torch.stack([c for c, _ in encoded])
    scales = torch.stack([s for _, s in encoded])
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    collectives.all_to_all(got_codes, codes, group, stats, kind=kind)
    collectives.all_to_all(got_scales, scales, group, stats, kind=kind.replace("int4", "scales"))
    total = torch.zeros(width, dtype=torch.float32, device=rows.device)
    for row_codes, row_scales in zip(got_codes, got_scales, strict=True):
        total += dequantize(row_codes, row_scales, width, q)
    return total


@dataclass(frozen=True, eq=False)
class QuantizedReduceScatter:
    """qgZ as the gradient buckets call it: the groups and the quantization, bound once."""

    groups: TwoLevelGroups
    q: BlockQuantization

    def __call__(self, output: torch.Tensor, input: torch.Tensor, stats: CommStats) -> None:
        quantized_reduce_scatter(output, input, self.groups, stats, self.q)


def two_level_error_bound(
    contributions: list[torch.Tensor], n: int, q: BlockQuantization, owner: int = 0
) -> torch.Tensor:
    """For tests: the bound of [Note: qgZ, the quantized two-level reduce-scatter] on the chunk of world rank
    `owner`, from every rank's full input (world order) on one process: half a step of each of the W step-1 blocks
    the chunk passed through, and of each of the k step-2 blocks."""
    world = len(contributions)
    k, chunk = world // n, contributions[0].numel() // world
    node_of_owner, local_of_owner = divmod(owner, n)
    bound = torch.zeros(chunk)
    for node in range(k):
        node_sum = torch.zeros(k * chunk)
        for local in range(n):
            row = contributions[node * n + local].float().view(k, n, chunk)[:, local_of_owner, :].reshape(-1)
            bound += error_bound(row, q).view(k, chunk)[node_of_owner]
            node_sum += dequantize(*quantize(row, q), row.numel(), q)
        bound += error_bound(node_sum.view(k, chunk)[node_of_owner], q)
    return bound
