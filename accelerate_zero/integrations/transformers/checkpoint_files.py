"""The Trainer's own files in a `checkpoint-N/` folder, checked before a resume reads them.

[Note: the Trainer's files are checksummed too]
The engine's shards are verified by their meta.json (checkpoint/meta.py). Beside them the Trainer writes its own
files: `trainer_state.json`, `scheduler.pt` (a scheduler the Trainer built), `rng_state_<rank>.pth` (one per process)
and `scaler.pt`. Read bare, a truncated one fails with torch's "PytorchStreamReader failed reading zip archive" and no
file name, on the rank that reads it only (the others then hang in their next collective), and a flipped byte can
load other values silently (measured: 121 of 1,465 single-bit flips of a scheduler.pt loaded a different step count
or learning rate). So once `_save_checkpoint` has written everything, the main process writes
`trainer_files.sha256.json` (their SHA-256s; written last, atomically), and every rank verifies every listed file
before a resume loads anything: all ranks refuse together, naming the file. A folder without the list (saved by an
earlier version, or killed between trainer_state.json and the list) resumes as before, unverified.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelerate_zero.checkpoint.meta import file_digest


MANIFEST_NAME = "trainer_files.sha256.json"
_PATTERNS = ("trainer_state.json", "scheduler.pt", "scaler.pt", "rng_state*.pth")


def write_manifest(checkpoint: str | os.PathLike[str]) -> None:
    """Records the SHA-256 of the Trainer's files in `checkpoint` (call after every rank has written its own)."""
    folder = Path(checkpoint)
    files = sorted({path for pattern in _PATTERNS for path in folder.glob(pattern) if path.is_file()})
    digests = {path.name: file_digest(path) for path in files}
    partial = folder / f".{MANIFEST_NAME}.partial"
    partial.write_text(json.dumps(digests, indent=1, sort_keys=True))
    os.replace(partial, folder / MANIFEST_NAME)


def verify_manifest(checkpoint: str | os.PathLike[str]) -> None:
    """Checks every file the manifest lists; nothing to check without a manifest.

    Raises:
        ValueError: naming the file that is missing, changed or truncated (or the manifest itself, if unreadable).
    """
    folder = Path(checkpoint)
    manifest = folder / MANIFEST_NAME
    if not manifest.is_file():
        return
    try:
        digests = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{manifest} is unreadable ({error}): restore it or resume from another checkpoint") from None
    if not isinstance(digests, dict):
        raise ValueError(f"{manifest} does not hold a file -> SHA-256 mapping: resume from another checkpoint")
    for name, expected in sorted(digests.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (listed in {MANIFEST_NAME}): resume from another checkpoint")
        if file_digest(path) != expected:
            raise ValueError(
                f"{path} does not match the SHA-256 recorded when it was saved ({MANIFEST_NAME}): it was truncated, "
                "corrupted or replaced; restore it or resume from another checkpoint"
            )
