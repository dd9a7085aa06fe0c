"""A rank's checkpoint data written in parts, so that a save never holds the whole shard in host memory.

[Note: a save streams its rank file in parts]
A save copies each fragment of the rank's shard (fp32 masters, optimizer state, frozen shards) to host memory and
writes it with safetensors, which writes a file from tensors that are all in memory at once. Collecting the whole
shard first put it all in host RAM during the save (for a 70B model at 8 ranks 105 GB per rank; under NVMe
offload, where the shard otherwise lives on disk, all of it at once). So the fragments are written as they come,
into parts of at most `SAVE_PART_BYTES` each: `rank00003.safetensors`, then `rank00003-001.safetensors`, ...
(checkpoint/io.py's FragmentReader finds a fragment in whichever file holds it; meta.json lists and checksums every
part). A small model's rank file is one part, named as before.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from accelerate_zero.checkpoint.meta import file_digest, rank_file_name


SAVE_PART_BYTES = 1 << 30
"""The most bytes of one rank's checkpoint data in host memory during a save (one part)."""
DIGEST_SUFFIX = ".sha256"


def part_name(rank: int, part: int) -> str:
    return rank_file_name(rank) if part == 0 else f"rank{rank:05d}-{part:03d}.safetensors"


class RankPartWriter:
    """Collects (key, host tensor) pairs and writes a part whenever `budget` bytes are pending; each part's SHA-256
    goes to a sidecar file that rank 0 collects into meta.json."""

    def __init__(
        self, folder: Path, rank: int, save: Callable[[dict[str, torch.Tensor], str], None], budget: int
    ) -> None:
        self.folder, self.rank, self._save, self.budget = folder, rank, save, budget
        self.parts = 0
        self.peak_bytes = 0
        """The most bytes pending at once (what the save held in host memory)."""
        self._pending: dict[str, torch.Tensor] = {}
        self._bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self._pending[key] = tensor.contiguous()
        self._bytes += tensor.numel() * tensor.element_size()
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        if self._bytes >= self.budget:
            self.flush()

    def flush(self) -> None:
        """Writes what is pending as the next part (at least one part is always written, maybe empty)."""
        if not self._pending and self.parts:
            return
        path = self.folder / part_name(self.rank, self.parts)
        self._save(self._pending, str(path))
        (self.folder / (path.name + DIGEST_SUFFIX)).write_text(file_digest(path))  # hashed by its writer, in parallel
        self.parts += 1
        self._pending, self._bytes = {}, 0
