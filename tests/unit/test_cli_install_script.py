"""scripts/install.sh shows its phases and pip's output, without pip's repeated "Location ... is ignored" lines,
and fails when pip fails (run against a stand-in virtual environment: nothing is installed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def _fake_venv(root: Path, pip_exit: int) -> Path:
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")  # the import check fails: install.sh installs
    (bin_dir / "pip").write_text(
        "#!/bin/sh\n"
        "echo \"WARNING: Location 'http://mirror.invalid/simple/torch/' is ignored: it is unreachable\" >&2\n"
        'echo "Collecting $*"\n'
        f"exit {pip_exit}\n"
    )
    for tool in ("python", "pip"):
        (bin_dir / tool).chmod(0o755)
    return root


def _install(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VENV": str(venv), "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    return subprocess.run(
        ["bash", "scripts/install.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_phases_and_pip_output_are_shown_without_location_warnings(tmp_path: Path) -> None:
    done = _install(_fake_venv(tmp_path / "venv", pip_exit=0))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("[install] ")][:3] == [
        "[install] 1/3 upgrading pip",
        "[install] 2/3 installing torch==2.13.0 from https://download.pytorch.org/whl/cpu (the largest download)",
        "[install] 3/3 installing accelerate_zero with the test and qlora extras (transformers, accelerate, trl, ...)",
    ]
    assert "Collecting install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in lines
    assert "Collecting install -e .[test,qlora]" in lines
    assert "is ignored" not in done.stdout + done.stderr


def test_a_failing_pip_fails_the_install(tmp_path: Path) -> None:
    done = _install(_fake_venv(tmp_path / "venv", pip_exit=3))
    assert done.returncode == 3
    assert "[install] 2/3" not in done.stdout
