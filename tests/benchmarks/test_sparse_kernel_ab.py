"""benchmarks/sparse_kernel_ab.py --quick: dense, this tree's kernel and a baseline kernels.py file, one table."""

from __future__ import annotations

import re
import shutil

import pytest

from sparseswaps_prune.deploy import kernels


def test_quick_run_times_the_current_kernel_and_a_baseline(benchmark_script, capsys, tmp_path):
    script = benchmark_script("sparse_kernel_ab")
    baseline = tmp_path / "kernels_copy.py"
    shutil.copy(kernels.__file__, baseline)
    script.main(["--quick", "--repeats", "1", "--baseline", str(baseline)])
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and f"kernel: {kernels.default_kernel()};" in out
    header = next(line.split() for line in out.splitlines() if line.split()[:1] == ["shape"])
    assert header[3:] == ["dense", "current", "x", "kernels_copy", "x"]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["64x300"]]
    assert [row[2] for row in rows] == ["1", "3"]
    for row in rows:
        cells, speedups = [row[3], *row[4::2]], row[5::2]
        assert all(len(cell.split("/")) == 2 for cell in cells) and all(float(s) > 0 for s in speedups)


def test_missing_baseline_is_refused(benchmark_script, tmp_path):
    script = benchmark_script("sparse_kernel_ab")
    with pytest.raises(SystemExit, match=r"--baseline .*no such file"):
        script.main(["--quick", "--baseline", str(tmp_path / "absent.py")])
    with pytest.raises(SystemExit, match="--repeats must be at least 1"):
        script.main(["--quick", "--repeats", "0"])


def test_shapes_replace_the_default_ones(benchmark_script, capsys):
    script = benchmark_script("sparse_kernel_ab")
    script.main(["--quick", "--repeats", "1", "--shapes", "16x40", "3x9"])
    words = [line.split()[:3] for line in capsys.readouterr().out.splitlines()]
    rows = [row for row in words if row and re.fullmatch(r"\d+x\d+", row[0])]
    assert rows == [["16x40", "70%", "1"], ["16x40", "70%", "3"], ["3x9", "70%", "1"], ["3x9", "70%", "3"]]
    for bad in ("16", "16x", "0x5", "ax5"):
        with pytest.raises(SystemExit, match=f"--shapes: '{bad}' is not OUTxIN"):
            script.main(["--quick", "--shapes", bad])
