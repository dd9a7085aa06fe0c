"""Which accelerate_zero the ranks import: this checkout's working tree, or a `git archive` of a commit.

`code_tree(code, folder)` gives the folder to put first on the ranks' PYTHONPATH (`launch.on_ranks(...,
env={"PYTHONPATH": str(tree)})`): a before/after comparison of two commits with the same benchmark code, or the
committed code while others edit the tree. No git state changes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def code_tree(code: str, folder: Path) -> tuple[Path, str]:
    """Where accelerate_zero is imported from: this checkout's working tree, or a `git archive` of a commit (HEAD,
    or any revision: a before/after comparison of two commits with the same benchmark code); no git state changes,
    so others may edit the tree during the run."""
    modified = git("diff", "--name-only", "HEAD", "--", "accelerate_zero").split()
    if code == "tree":
        commit = git("rev-parse", "--short", "HEAD")
        state = f"{len(modified)} modified files in accelerate_zero/" if modified else "accelerate_zero/ as committed"
        return REPO, f"working tree at {commit} ({state})"
    revision = "HEAD" if code == "head" else code
    commit = git("rev-parse", "--short", f"{revision}^{{commit}}")
    if not commit:
        raise SystemExit(f"--code/--baseline {code}: not a commit of {REPO}; use tree, head or a revision git knows")
    snapshot = folder / f"code_{commit}"
    snapshot.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(snapshot)], input=archive.stdout, check=True)
    unused = f", {len(modified)} modified files in the tree's accelerate_zero/ not used" if modified else ""
    name = "HEAD " if revision == "HEAD" else ""
    return snapshot, f"accelerate_zero from a git archive of {name}{commit}{unused}"


def git(*command: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *command], capture_output=True, text=True, check=False)
    return done.stdout.strip()
