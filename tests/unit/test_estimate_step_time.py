"""[Note: the offload step time model] (debug/step_time.py) and `accelerate-zero estimate --step_seconds --copy_gbps
--host_rate` (cli/estimate_time.py): the prediction's parts by hand, and the CLI rows that carry them."""

from __future__ import annotations

import pytest

from accelerate_zero.debug.step_time import Measured, offload_step_seconds
from tests.unit.test_estimate import estimate_json, run_cli


MEASURED = Measured(step_seconds=0.6, copy_gbps=20.0, host_rate=1e9)
N = 1_000_000_000


def test_optimizer_offload_adds_exposed_gradient_copies_the_host_step_and_the_last_chunk() -> None:
    # stage 3, 4 micro-steps: 4 x 4 bytes x 1e9 / 20e9 = 0.8 s of gradient copies beside 0.4 s of backward
    parts = offload_step_seconds(N, 3, "cpu", 4, MEASURED, overlapped=False)
    assert parts == {
        "no_offload": 0.6,
        "gradients_to_host": 0.4,
        "host_step": 1.0,
        "uploads": round(2**24 * 4 / 20e9, 4),  # only the last chunk's upload is exposed
        "parameter_reads": 0.0,
        "hidden_behind_forward": 0.0,
        "total": round(0.6 + 0.4 + 1.0 + 2**24 * 4 / 20e9, 4),
    }
    # the engine's default at stage 3: the host step runs during the next first forward (0.6 / 3 / 4 = 0.05 s)
    overlapped = offload_step_seconds(N, 3, "cpu", 4, MEASURED)
    assert overlapped["hidden_behind_forward"] == 0.05 and overlapped["host_step"] == 0.95
    assert overlapped["total"] == round(parts["total"] - 0.05, 4)
    assert offload_step_seconds(N, 2, "cpu", 4, MEASURED)["hidden_behind_forward"] == 0.0  # synchronous there
    fast_host = offload_step_seconds(N, 3, "cpu", 1, Measured(step_seconds=0.6, copy_gbps=20.0, host_rate=1e11))
    assert fast_host["host_step"] == 0.0 and fast_host["uploads"] == 0.0  # 0.01 s + one chunk behind 0.2 s
    # stage 1 reduces once per step: 0.2 s of copies hide behind backward
    assert offload_step_seconds(N, 1, "cpu", 4, MEASURED)["gradients_to_host"] == 0.0
    assert offload_step_seconds(N, 3, "none", 4, MEASURED)["total"] == 0.6


def test_parameter_offload_reads_every_shard_twice_per_micro_step() -> None:
    parts = offload_step_seconds(N, 3, "cpu+param", 2, MEASURED)
    # 2 micro-steps x (forward + backward) x 2 bytes x 1e9 / 20e9 = 0.4 s, hidden behind 0.6 s of compute
    assert parts["parameter_reads"] == 0.0 and parts["uploads"] == 0.0
    slow = Measured(step_seconds=0.6, copy_gbps=2.0, host_rate=1e9)
    assert offload_step_seconds(N, 3, "cpu+param", 2, slow)["parameter_reads"] == pytest.approx(4.0 - 0.6)


def test_what_the_model_does_not_cover_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="offload='nvme': the step time model covers none, cpu and cpu\\+param"):
        offload_step_seconds(N, 3, "nvme", 1, MEASURED)
    with pytest.raises(ValueError, match="parameter offload needs stage 3"):
        offload_step_seconds(N, 2, "cpu+param", 1, MEASURED)
    with pytest.raises(ValueError, match="copy_gbps=0.0: must be a measured figure > 0"):
        Measured(step_seconds=1.0, copy_gbps=0.0, host_rate=1.0)


def test_the_cli_predicts_each_row_from_the_three_figures(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--params", "1e9", "--num_gpus", "2", "--step_seconds", "0.6", "--copy_gbps", "20", "--host_rate", "1e9"]
    report = estimate_json(capsys, *flags, "--accumulation", "4")
    rows = {(r["stage"], r["offload"]): r["step_seconds"] for r in report["estimates"]}
    assert rows[(3, "nvme")] is None and rows[(0, "none")]["total"] == 0.6
    # two GPUs: each rank steps half of the elements (0.5 s), 0.05 s of it behind the next first forward
    assert rows[(3, "cpu")]["host_step"] == 0.45 and rows[(2, "cpu")]["host_step"] == 0.5
    assert rows[(3, "cpu")] == offload_step_seconds(N // 2, 3, "cpu", 4, MEASURED)
    code, out, _ = run_cli(capsys, *flags)
    assert code == 0 and "predicted step time (s) from the measured figures:" in out
    assert "stage 3 cpu+param" in out
    plain = estimate_json(capsys, "--params", "1e9", "--num_gpus", "2")
    assert all(r["step_seconds"] is None for r in plain["estimates"])
    code, _, err = run_cli(capsys, "--params", "1e9", "--step_seconds", "0.6")
    assert code == 2 and "add --copy_gbps, --host_rate" in err
