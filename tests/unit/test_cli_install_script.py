"""scripts/install.sh shows its phases and pip's output, without pip's repeated "Location ... is ignored" lines,
fails when pip fails, installs deepspeed without its ops, and installs into a .venv that lacks deepspeed (run against
a stand-in virtual environment: nothing is installed)."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def _fake_venv(root: Path, pip_exit: int) -> Path:
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")  # the import check fails: install.sh installs
    (bin_dir / "pip").write_text(
        "#!/bin/sh\n"
        "echo \"WARNING: Location 'http://mirror.invalid/simple/torch/' is ignored: it is unreachable\" >&2\n"
        'echo "Collecting $* (DS_BUILD_OPS=${DS_BUILD_OPS-unset})"\n'
        f"exit {pip_exit}\n"
    )
    for tool in ("python", "pip"):
        (bin_dir / tool).chmod(0o755)
    return root


def _install(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VENV": str(venv), "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"}
    env["DS_BUILD_OPS"] = "1"  # a user's setting: install.sh still builds deepspeed without ops
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
        "[install] 3/3 installing accelerate_zero with the test and qlora extras (transformers, accelerate, trl, "
        "deepspeed without its ops, ...)",
    ]
    assert (
        "Collecting install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (DS_BUILD_OPS=0)" in lines
    )
    assert "Collecting install -e .[test,qlora] (DS_BUILD_OPS=0)" in lines
    assert "is ignored" not in done.stdout + done.stderr


def test_a_failing_pip_fails_the_install(tmp_path: Path) -> None:
    done = _install(_fake_venv(tmp_path / "venv", pip_exit=3))
    assert done.returncode == 3
    assert "[install] 2/3" not in done.stdout


def _venv_with(root: Path, *, deepspeed: bool) -> Path:
    """A stand-in venv whose python (the real one, on stand-in packages only) has torch, accelerate_zero, pytest,
    bitsandbytes and trl, and deepspeed's metadata when `deepspeed`; its pip fails, so installing shows."""
    venv = _fake_venv(root / "venv", pip_exit=7)
    packages = root / "packages"
    for name in ("torch", "accelerate_zero", "pytest", "bitsandbytes", "trl"):
        (packages / name).mkdir(parents=True)
        (packages / name / "__init__.py").write_text("")
    if deepspeed:
        (packages / "deepspeed-0.19.8.dist-info").mkdir()
        (packages / "deepspeed-0.19.8.dist-info" / "METADATA").write_text("Name: deepspeed\nVersion: 0.19.8\n")
    python = venv / "bin" / "python"
    # -S: no site-packages; run from `packages`, not from the checkout (whose accelerate_zero needs torch)
    python.write_text(f'#!/bin/sh\ncd "{packages}" && PYTHONPATH="{packages}" exec "{sys.executable}" -S "$@"\n')
    return venv


def test_a_venv_with_everything_is_kept(tmp_path: Path) -> None:
    done = _install(_venv_with(tmp_path, deepspeed=True))
    assert done.returncode == 0 and "already has accelerate_zero and its extras" in done.stdout


def test_a_venv_without_deepspeed_gets_it(tmp_path: Path) -> None:
    done = _install(_venv_with(tmp_path, deepspeed=False))  # a .venv made before deepspeed joined the test extra
    assert done.returncode == 7 and "[install] 1/3 upgrading pip" in done.stdout


def test_the_test_extra_pins_deepspeed() -> None:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    extra = [line.strip() for line in setup["options.extras_require"]["test"].splitlines()]
    assert "deepspeed==0.19.8" in extra  # `accelerate launch` with a DEEPSPEED config needs it (test_migration.py)
