"""Stateless collectives on flat tensors; the only module that calls torch.distributed collectives.

Every call is counted in a `CommStats`, so the bytes the engine moves are measured where they are moved.
`bytes_per_rank` follows the algorithms the backends run: with NCCL a reduce-scatter or all-gather of an N-byte
buffer sends N*(W-1)/W bytes from each rank, an all-reduce twice that, a broadcast N bytes.

[Note: reduce-scatter on gloo]
gloo has no reduce-scatter algorithm: torch implements it as an all-reduce of a copy of the input, then keeps one
chunk (bench/overlap.py: twice the bytes of a ring reduce-scatter, and a full-size temporary). We run it
as point-to-point messages instead: every rank sends chunk j of its partial sums to rank j and receives the W - 1
other partial sums of its own chunk, which `wait()` adds to its own in rank order (r_0 + r_1 + ... + r_{W-1}, the
order of the definition: the same values on every rank and at every W). Each rank sends N*(W-1)/W bytes, as in a
ring, and the messages move on gloo's own threads, so an asynchronous reduce-scatter lets backward go on while the
first round moves. gloo's all-to-all did the same exchange before (issue 51): per 132 MB bucket at W = 2 it cost
140-150 ms of CPU time against 35-45 ms for the messages (its own chunk copied to itself, an extra copy of every
chunk inside gloo, and a sum over the received rows twice as slow as an add), more than the all-reduce DDP runs on
twice the data (45-60 ms). A bucket is reduced in rounds over column ranges of the W chunks, so the received
temporary, (W - 1)/W of `GLOO_ROUND_NUMEL`, never grows with the bucket; the engine keeps at most two reductions in
flight.

[Note: all-gather on gloo]
gloo's all-gather writes into a full-size temporary of its own and copies it into the output afterwards: a fresh
block per call (page faults in host memory) and a second pass over the result. We run it as W broadcasts instead,
rank r's slice sent from rank r straight into slice r of the output on every rank: nothing temporary, and each rank
sends its slice to the W-1 others, N*(W-1)/W bytes as in a ring. bench/overlap.py at W = 2 on 41 MB: 92 ms
for the all-gather, 31 ms for the broadcasts. They are issued together; `wait()` waits for all of them.

[Note: bytes between nodes]
What crosses node boundaries is counted by the volume a node-aware algorithm moves (NCCL's rings and trees are
ordered by node), from the node of each member of the group (`DataParallelGroup.member_nodes`): a piece of data
enters a node once and is shared inside it. For a group of g ranks with m_i of them on node i, and N bytes:
- all-gather (N gathered) and reduce-scatter (N reduced): node i receives (or sends) the (g - m_i)/g of N held
  elsewhere: sum_i N (g - m_i)/g in all, (k - 1) N over k equal nodes; an all-reduce is both, twice that;
- broadcast of N: every other node receives it once, (k - 1) N;
- scatter of N in all from the source: N (g - m_src)/g;
- all-to-all of N per rank: each rank's N/g for every member on another node, sum_r N/g (g - m_node(r)).
Each rank records 1/g of its collective's total, so summing `between_nodes_bytes` over the ranks gives the bytes
that crossed nodes (bench/README.md and tests/distributed/test_layouts.py compare them with formulas).

Every collective runs outside torch.compile's graphs ([Note: compiling around ZeRO's hooks] in
engine/compile_boundary.py): one that a compiled forward reaches breaks the graph there and runs eagerly.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from accelerate_zero.engine.compile_boundary import outside_compile
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.scratch import ScratchBuffers


# torch 2.13 renamed the tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveCount:
    calls: int = 0
    payload_bytes: int = 0
    """Size of the full buffer each call worked on (the input of a reduce, the output of a gather)."""
    bytes_per_rank: float = 0.0
    """Bytes each rank sends, by the ring algorithm's volume."""
    between_nodes_bytes: float = 0.0
    """This rank's share of the bytes that crossed node boundaries ([Note: bytes between nodes])."""


class CollectiveLog(Protocol):
    """What times each collective (the config's `comms_logger`: accelerate_zero/monitor/comms.py)."""

    def wants(self, kind: str) -> bool: ...

    def add(self, kind: str, payload_bytes: int, seconds: float) -> None: ...


@dataclass
class CommStats:
    """Bytes moved per collective kind since the last `reset()`; with a `log`, the latency of each collective.

    [Note: timing collectives] A collective's time is only known once it has completed: with a `log` that wants its
    kind, each collective is waited for (and the device synchronized) right after it is issued, as DeepSpeed's
    comms logger makes every op blocking. The engine then overlaps no communication: the times are the
    collectives' own, the step is slower. Without a log nothing changes."""

    by_kind: dict[str, CollectiveCount] = field(default_factory=dict)
    log: CollectiveLog | None = None
    _issued: tuple[str, int, float] | None = None

    def record(self, kind: str, payload_bytes: int, ring_factor: float, between_nodes: float = 0.0) -> None:
        count = self.by_kind.setdefault(kind, CollectiveCount())
        count.calls += 1
        count.payload_bytes += payload_bytes
        count.bytes_per_rank += payload_bytes * ring_factor
        count.between_nodes_bytes += between_nodes
        if self.log is not None and self.log.wants(kind):
            self._issued = (kind, payload_bytes, time.perf_counter())

    def reset(self) -> None:
        self.by_kind.clear()

    def as_dict(self) -> dict[str, dict[str, float]]:
        out = {kind: vars(count).copy() for kind, count in sorted(self.by_kind.items())}
        out["total"] = {
            "calls": sum(c.calls for c in self.by_kind.values()),
            "payload_bytes": sum(c.payload_bytes for c in self.by_kind.values()),
            "bytes_per_rank": sum(c.bytes_per_rank for c in self.by_kind.values()),
            "between_nodes_bytes": sum(c.between_nodes_bytes for c in self.by_kind.values()),
        }
        return out


def between_nodes(dp: DataParallelGroup, pattern: str, nbytes: float, src: int = 0) -> float:
    """This rank's share of what a collective on `dp` sends between nodes ([Note: bytes between nodes]).
    `pattern`: "gather" (all-gather, reduce-scatter), "all_reduce", "broadcast", "scatter" or "all_to_all";
    `src`: the source's group rank (broadcast, scatter)."""
    members = dp.members_per_node
    if not members:
        return 0.0
    g = dp.world_size
    if pattern in ("gather", "all_reduce"):
        total = sum(nbytes * (g - m) / g for m in members.values()) * (2 if pattern == "all_reduce" else 1)
    elif pattern == "broadcast":
        total = nbytes * (len(members) - 1)
    elif pattern == "scatter":
        assert dp.member_nodes is not None
        total = nbytes * (g - members[dp.member_nodes[src]]) / g
    elif pattern == "all_to_all":  # each of a node's m members sends N/g to each of the g - m members elsewhere
        total = sum(nbytes / g * m * (g - m) for m in members.values())
    else:
        raise ValueError(f"unknown collective pattern {pattern!r}")
    return total / g


class Pending(NamedTuple):
    """An issued collective; `wait()` before reading its output (and before touching its input)."""

    work: dist.Work | None
    finish: Callable[[], None] | None = None
    """Local work that completes the output once the collective is done (holds its temporaries until then)."""

    @outside_compile
    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.finish is not None:
            self.finish()


def _timed(stats: CommStats, pending: Pending, tensor: torch.Tensor) -> Pending:
    """`pending`, or, when the log times this collective, completed and timed ([Note: timing collectives])."""
    if stats._issued is None:
        return pending
    kind, payload_bytes, start = stats._issued
    stats._issued = None
    pending.wait()
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    assert stats.log is not None
    stats.log.add(kind, payload_bytes, time.perf_counter() - start)
    return Pending(None)


def _done_unless_async(pending: Pending, async_op: bool) -> Pending:
    """Our own algorithms always start asynchronously: a synchronous call completes here."""
    if async_op:
        return pending
    pending.wait()
    return Pending(None)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@outside_compile
def all_reduce(
    tensor: torch.Tensor, dp: DataParallelGroup, stats: CommStats, *, async_op: bool = False, kind: str = "all_reduce"
) -> Pending:
    """Sums `tensor` over the group, in place."""
    if dp.world_size == 1:
        return Pending(None)
    nbytes = _nbytes(tensor)
    stats.record(kind, nbytes, 2 * (dp.world_size - 1) / dp.world_size, between_nodes(dp, "all_reduce", nbytes))
    return _timed(stats, Pending(dist.all_reduce(tensor, group=dp.group, async_op=async_op)), tensor)


@outside_compile
def all_reduce_max(tensor: torch.Tensor, dp: DataParallelGroup, stats: CommStats) -> None:
    """Takes the element-wise maximum over the group, in place (synchronous)."""
    if dp.world_size == 1:
        return
    nbytes = _nbytes(tensor)
    stats.record(
        "all_reduce", nbytes, 2 * (dp.world_size - 1) / dp.world_size, between_nodes(dp, "all_reduce", nbytes)
    )
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp.group)
    _timed(stats, Pending(None), tensor)


@outside_compile
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    dp: DataParallelGroup,
    stats: CommStats,
    *,
    async_op: bool = False,
    scratch: ScratchBuffers | None = None,
) -> Pending:
    """Sums `input` over the group and leaves slice `rank` of the sum in `output`.

    `output` may be this rank's slice of `input` (in place): NCCL documents it, gloo does it correctly. `scratch`:
    where a temporary the algorithm needs comes from and goes back to once the result is complete.
    """
    if dp.world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Pending(None)
    own_slice = input.data_ptr() + dp.rank * output.numel() * output.element_size()
    nbytes = _nbytes(input)
    stats.record("reduce_scatter", nbytes, (dp.world_size - 1) / dp.world_size, between_nodes(dp, "gather", nbytes))
    if dp.backend == "gloo" and output.data_ptr() == own_slice:
        pending = _p2p_reduce_scatter([input], dp, scratch or ScratchBuffers(input.device, reuse=False))
        return _timed(stats, _done_unless_async(pending, async_op), output)
    return _timed(stats, Pending(_reduce_scatter_single(output, input, group=dp.group, async_op=async_op)), output)


# The received partial sums of one round of [Note: reduce-scatter on gloo], at most (4 MiB in fp32): a larger
# bucket (a decoder layer of 7M parameters, a 32K-vocabulary LM head) is reduced in rounds over column ranges of the
# W chunks, so the temporary never grows with the bucket. Only the first round overlaps backward (the others run in
# `wait()`), so a larger round overlaps more and holds more: at 16 MiB a decoder layer of 28 MB held 16.8 MB received
# beside its own gradient and the next layer's, and the backward peaked above FSDP2's (issue 44, item 12).
GLOO_ROUND_NUMEL = 1 << 20
GLOO_MIN_ROUNDS = 4
"""A bucket smaller than the rounds above is still reduced in this many: the received temporary of a stage-3 unit
(a Linear(1024) of 4.2 MB at W = 4: 3.1 MB in one round) is then (W - 1)/4 of its chunk, beside the unit's gradient
in backward (issue 51, item 5)."""
GLOO_REDUCE_SCATTER_TAG = 5101
"""The tag of the reduce-scatter's point-to-point messages: messages between two ranks with one tag are matched in
the order they were issued, which is the same on every rank (as for every collective)."""


def reads_pieces(dp: DataParallelGroup) -> bool:
    """Whether `reduce_scatter_pieces` can run on `dp`: it reads the pieces where they are ([Note: a reduce-scatter
    of pieces]), which only our own gloo algorithm does; NCCL reduces one contiguous buffer."""
    return dp.world_size > 1 and dp.backend == "gloo"


def reduce_scatter_pieces(
    pieces: Sequence[torch.Tensor],
    dp: DataParallelGroup,
    stats: CommStats,
    *,
    async_op: bool = False,
    scratch: ScratchBuffers | None = None,
) -> Pending:
    """Sums over the group the 1D tensor that the 1D `pieces` make end to end (W equal chunks) and leaves chunk
    `rank` of the sum in the elements of `pieces` that hold that chunk, in place ([Note: a reduce-scatter of
    pieces]). Every rank passes pieces of the same sizes in the same order. Only where `reads_pieces(dp)`."""
    if not reads_pieces(dp):
        raise ValueError(f"reduce_scatter_pieces needs a gloo group of 2 ranks or more, got {dp.world_size} rank(s)")
    numel = sum(piece.numel() for piece in pieces)
    if numel % dp.world_size:
        raise ValueError(f"reduce_scatter_pieces: {numel} elements do not split into {dp.world_size} equal chunks")
    nbytes = numel * pieces[0].element_size()
    stats.record("reduce_scatter", nbytes, (dp.world_size - 1) / dp.world_size, between_nodes(dp, "gather", nbytes))
    pending = _p2p_reduce_scatter(pieces, dp, scratch or ScratchBuffers(pieces[0].device, reuse=False))
    return _timed(stats, _done_unless_async(pending, async_op), pieces[0])


class _Segment(NamedTuple):
    tensor: torch.Tensor
    """A view of one piece."""
    start: int
    """Where it starts inside the range asked for."""


def _segments(pieces: Sequence[torch.Tensor], starts: list[int], lo: int, hi: int) -> list[_Segment]:
    """Views of `pieces` (piece i starting at `starts[i]`) covering elements [lo, hi) of their concatenation."""
    out, position = [], lo
    index = bisect.bisect_right(starts, lo) - 1
    while position < hi:
        piece, piece_start = pieces[index], starts[index]
        end = min(hi, piece_start + piece.numel())
        if end > position:
            out.append(_Segment(piece[position - piece_start : end - piece_start], position - lo))
        position, index = max(position, end), index + 1
    return out


# [Note: a reduce-scatter of pieces]
# A stage-2/3 bucket's gradient is the concatenation of its parameters' gradients. Copying them into one full-size
# buffer before the reduction holds that buffer beside autograd's gradient of each parameter while it is copied,
# and with a reduction in flight beside it, three full-size gradients at once (issue 51, item 5). The point-to-point
# algorithm below never needs the concatenation: each message is a contiguous range of one chunk, so it can be cut
# where two pieces meet and sent from (or received beside) the pieces themselves. Every rank must cut at the same
# places, so the pieces are the bucket's plan (one per parameter slot, and the padding), never what happened to
# arrive on a rank. The sum of a rank's chunk is written over its own pieces, element for element the additions of
# the one-buffer case, so the result is the same bit for bit.
def _p2p_reduce_scatter(pieces: Sequence[torch.Tensor], dp: DataParallelGroup, scratch: ScratchBuffers) -> Pending:
    """[Note: reduce-scatter on gloo] over [Note: a reduce-scatter of pieces]: asynchronous; `wait()` adds the
    received partial sums over this rank's chunk of the pieces (the first round is in flight on return, the others
    run in `wait()`)."""
    world, rank = dp.world_size, dp.rank
    starts = list(itertools.accumulate((piece.numel() for piece in pieces[:-1]), initial=0))
    shard = (starts[-1] + pieces[-1].numel()) // world
    if shard == 0:
        return Pending(None)
    peers = [r for r in range(world) if r != rank]
    address = [r if dp.group is None else dist.get_global_rank(dp.group, r) for r in peers]
    width = max(1, min(GLOO_ROUND_NUMEL // world, -(-shard // GLOO_MIN_ROUNDS)))
    received = scratch.take(width * len(peers), pieces[0].dtype)
    parts = received.view(len(peers), width)

    def start(lo: int) -> list[dist.Work]:
        hi = min(lo + width, shard)
        own = _segments(pieces, starts, rank * shard + lo, rank * shard + hi)
        works = []
        for index, (peer, peer_address) in enumerate(zip(peers, address, strict=True)):
            for segment in _segments(pieces, starts, peer * shard + lo, peer * shard + hi):
                works.append(dist.isend(segment.tensor, peer_address, dp.group, GLOO_REDUCE_SCATTER_TAG))
            for segment in own:
                into = parts[index, segment.start : segment.start + segment.tensor.numel()]
                works.append(dist.irecv(into, peer_address, dp.group, GLOO_REDUCE_SCATTER_TAG))
        return works

    def add_round(lo: int, hi: int) -> None:
        own, others = _segments(pieces, starts, rank * shard + lo, rank * shard + hi), parts[:, : hi - lo]
        # r_0 + ... + r_{W-1} in rank order; `own` (r_rank) is added to the sum of the ranks below it, which equals
        # that sum plus `own` exactly (floating-point addition commutes).
        if rank > 0:
            below = others[0]
            for index in range(1, rank):
                below.add_(others[index])
            for segment in own:
                segment.tensor.add_(below[segment.start : segment.start + segment.tensor.numel()])
        for index in range(rank, len(peers)):
            for segment in own:
                segment.tensor.add_(others[index, segment.start : segment.start + segment.tensor.numel()])

    first = start(0)

    def finish_rounds() -> None:
        works, lo = first, 0
        while True:
            for work in works:
                work.wait()
            hi = min(lo + width, shard)
            add_round(lo, hi)
            lo = hi
            if lo >= shard:
                break
            works = start(lo)
        scratch.give(received)

    return Pending(None, finish_rounds)


@outside_compile
def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    dp: DataParallelGroup,
    stats: CommStats,
    *,
    async_op: bool = False,
    kind: str = "all_gather",
) -> Pending:
    """Concatenates every rank's `input` into `output`; `input` may be this rank's slice of `output`."""
    if dp.world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Pending(None)
    nbytes = _nbytes(output)
    stats.record(kind, nbytes, (dp.world_size - 1) / dp.world_size, between_nodes(dp, "gather", nbytes))
    if dp.backend == "gloo":
        return _timed(stats, _done_unless_async(_broadcast_all_gather(output, input, dp), async_op), output)
    return _timed(stats, Pending(_all_gather_single(output, input, group=dp.group, async_op=async_op)), output)


def _broadcast_all_gather(output: torch.Tensor, input: torch.Tensor, dp: DataParallelGroup) -> Pending:
    """[Note: all-gather on gloo]: every rank's slice broadcast in place into `output`, asynchronously."""
    assert output.numel() == input.numel() * dp.world_size and output.dtype == input.dtype, "all_gather: shapes"
    slices = output.view(dp.world_size, -1)
    if slices[dp.rank].data_ptr() != input.data_ptr():
        slices[dp.rank].copy_(input)
    works = [
        dist.broadcast(
            slices[r], src=r if dp.group is None else dist.get_global_rank(dp.group, r), group=dp.group, async_op=True
        )
        for r in range(dp.world_size)
    ]

    def finish() -> None:
        for work in works:
            work.wait()

    return Pending(None, finish)


@outside_compile
def all_to_all(
    output: torch.Tensor, input: torch.Tensor, dp: DataParallelGroup, stats: CommStats, *, kind: str = "all_to_all"
) -> None:
    """Row i of `input` (its first dimension is the group size) to group rank i; row j of `output` from group rank
    j (synchronous)."""
    if dp.world_size == 1:
        output.copy_(input)
        return
    nbytes = _nbytes(input)
    stats.record(kind, nbytes, (dp.world_size - 1) / dp.world_size, between_nodes(dp, "all_to_all", nbytes))
    dist.all_to_all_single(output, input, group=dp.group)
    _timed(stats, Pending(None), output)


@outside_compile
def all_to_all_uneven(
    input: torch.Tensor,
    send_counts: list[int],
    receive_counts: list[int],
    dp: DataParallelGroup,
    stats: CommStats,
    *,
    kind: str = "all_to_all",
) -> torch.Tensor:
    """The first `send_counts[i]` rows of `input` (after those for ranks below i) to group rank i; returns the rows
    received, `receive_counts[j]` from group rank j, in rank order (synchronous; counts may be 0)."""
    output = input.new_empty((sum(receive_counts), *input.shape[1:]))
    if dp.world_size == 1:
        output.copy_(input)
        return output
    row_bytes = input[:1].numel() * input.element_size()
    nbytes = (sum(send_counts) - send_counts[dp.rank]) * row_bytes  # what leaves this rank
    stats.record(kind, nbytes, 1.0, between_nodes(dp, "all_to_all", nbytes))
    dist.all_to_all_single(output, input.contiguous(), receive_counts, send_counts, group=dp.group)
    _timed(stats, Pending(None), output)
    return output


@outside_compile
def broadcast(
    tensor: torch.Tensor, src_rank: int, dp: DataParallelGroup, stats: CommStats, *, async_op: bool = False
) -> Pending:
    """Copies `tensor` from group rank `src_rank` to every rank, in place."""
    if dp.world_size == 1:
        return Pending(None)
    nbytes = _nbytes(tensor)
    stats.record("broadcast", nbytes, 1.0, between_nodes(dp, "broadcast", nbytes, src_rank))
    src = src_rank if dp.group is None else dist.get_global_rank(dp.group, src_rank)
    return _timed(stats, Pending(dist.broadcast(tensor, src=src, group=dp.group, async_op=async_op)), tensor)


@outside_compile
def scatter(output: torch.Tensor, inputs: list[torch.Tensor] | None, dp: DataParallelGroup, stats: CommStats) -> None:
    """Rank 0's `inputs[r]` into `output` on each rank r (`inputs`: rank 0's list, None elsewhere; synchronous)."""
    if dp.world_size == 1:
        assert inputs is not None and len(inputs) == 1
        if output.data_ptr() != inputs[0].data_ptr():
            output.copy_(inputs[0])
        return
    nbytes = _nbytes(output) * dp.world_size
    stats.record("scatter", nbytes, (dp.world_size - 1) / dp.world_size, between_nodes(dp, "scatter", nbytes))
    src = 0 if dp.group is None else dist.get_global_rank(dp.group, 0)
    dist.scatter(output, inputs if dp.rank == 0 else None, src=src, group=dp.group)
    _timed(stats, Pending(None), output)


@outside_compile
def barrier(dp: DataParallelGroup) -> None:
    """Returns once every rank of the group has called it (checkpoint folders, shared disk-space tallies)."""
    if dp.world_size > 1:
        dist.barrier(group=dp.group)


@outside_compile
def all_gather_object(obj: object, dp: DataParallelGroup) -> list[object]:
    """Every rank's `obj` (picklable, small: tags, flags), in rank order. Pickles: never call it on loaded data."""
    if dp.world_size == 1:
        return [obj]
    out: list[object] = [None] * dp.world_size
    dist.all_gather_object(out, obj, group=dp.group)
    return out
