"""benchmarks/sparse_linear_call.py --quick: the kernel, this SparseLinear and a baseline linear.py, one table."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sparseswaps_prune.deploy import linear


def test_quick_run_times_the_current_module_and_a_baseline(benchmark_script, capsys, tmp_path):
    script = benchmark_script("sparse_linear_call")
    baseline = tmp_path / "linear_copy.py"
    shutil.copy(linear.__file__, baseline)
    script.main(["--quick", "--baseline", str(baseline)])
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "one token, 60% sparsity" in out
    header = next(line.split() for line in out.splitlines() if line.split()[:1] == ["shape"])
    assert header[1:] == ["bias", "kernel", "current", "cost", "linear_copy", "cost"]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["16x64"]]
    assert [row[1] for row in rows] == ["no", "yes"]
    for row in rows:
        kernel, current, cost = float(row[2]), float(row[3]), float(row[4])
        assert kernel > 0 and current > 0 and cost == pytest.approx(current - kernel, abs=0.11)


def test_a_baseline_with_other_outputs_or_missing_is_refused(benchmark_script, tmp_path):
    script = benchmark_script("sparse_linear_call")
    with pytest.raises(SystemExit, match=r"--baseline .*no such file"):
        script.main(["--quick", "--baseline", str(tmp_path / "absent.py")])
    wrong = tmp_path / "linear_wrong.py"
    source = Path(linear.__file__).read_text()
    wrong.write_text(
        source.replace(
            "return y.reshape(*x.shape[:-1], self.out_features)",
            "return 2 * y.reshape(*x.shape[:-1], self.out_features)",
        )
    )
    with pytest.raises(RuntimeError, match="linear_wrong's SparseLinear gives other outputs"):
        script.main(["--quick", "--baseline", str(wrong)])
