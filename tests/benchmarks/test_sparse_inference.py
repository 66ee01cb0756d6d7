"""benchmarks/sparse_inference.py --quick: every section runs and prints its table (small shapes, a tiny model)."""

from __future__ import annotations


def test_quick_run_prints_every_section(benchmark_script, capsys):
    script = benchmark_script("sparse_inference")
    script.main(["--quick", "--repeats", "2"])
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "torch " in out and "threads" in out
    assert "median of 2 timed runs" in out.split("(b) greedy decoding")[1]  # --repeats reaches the model sections
    for title in ("(a) one layer", "(b) greedy decoding", "(c) memory", "(d) checkpoint size", "(e) least checkpoint"):
        assert title in out
    layer = [line.split() for line in out.split("(a) one layer")[1].splitlines() if line.split()[:1] == ["256x512"]]
    assert [row[2] for row in layer] == ["1", "4"]
    assert layer[0][6] != "-" and layer[1][6:8] == ["-", "-"]  # torch CSR timed at batch 1 only in --quick
    assert all(float(row[-1]) < 1e-5 for row in layer)  # relative error of the kernel
    decode = out.split("(b) greedy decoding")[1].split("(c)")[0]
    table, split = decode.split("where a token's time goes")
    assert table.strip().splitlines()[-1].split()[-1] == "yes"  # same tokens dense and sparse
    row = split.strip().splitlines()[-1].split()
    assert row[:2] == ["60%", "1"] and float(row[2]) > 0 and float(row[3]) > 0
    assert float(row[-1]) > 1.0  # the speedup with free linears is a bound above 1
    rows = _checkpoint_rows(out)
    assert [row[1:3] for row in rows] == [["float32", "own"], ["bfloat16", "own"]]
    _check_bound_section(out)


def _checkpoint_rows(out: str) -> list[list[str]]:
    """Section (d)'s rows, checked: bit-exact round trips, the sparse file below the dense one and the compressed
    one below the sparse one."""
    disk = out.split("(d) checkpoint size")[1].split("(e)")[0].splitlines()
    rows = [line.split() for line in disk if line.strip().startswith("60%")]
    for row in rows:
        assert row[-1] == "bit-exact" and float(row[7]) < float(row[5]) < 1.0, row
        assert all(float(seconds) > 0 for seconds in row[8:12]), row
    return rows


def test_checkpoint_section_alone_compares_plain_and_compressed(benchmark_script, capsys):
    script = benchmark_script("sparse_inference")
    script.main(["--quick", "--checkpoint"])
    out = capsys.readouterr().out
    assert "(a) one layer" not in out and "(e) least checkpoint" not in out
    rows = _checkpoint_rows(out)
    assert [row[1:3] for row in rows] == [["float32", "own"], ["bfloat16", "own"], ["float32", "normal"],
                                          ["bfloat16", "normal"]]  # fmt: skip


def test_redraw_keeps_each_tensors_scale(benchmark_script):
    import torch

    script = benchmark_script("sparse_inference")
    model = torch.nn.Linear(256, 64)
    with torch.no_grad():
        model.weight.mul_(5.0).add_(1.0)
    before = {k: (v.mean().item(), v.std().item()) for k, v in model.state_dict().items()}
    old = model.weight.detach().clone()
    script.redraw_normal_(model)
    assert not torch.equal(model.weight, old)
    for name, (mean, std) in before.items():
        value = model.state_dict()[name]
        assert abs(value.mean().item() - mean) < 0.2 * std and abs(value.std().item() / std - 1) < 0.2, name


def _check_bound_section(out: str) -> None:
    bound = [line.split() for line in out.split("(e) least checkpoint")[1].splitlines() if "%" in line]
    tiny = [row for row in bound if row[:2] == ["tiny", "llama"]]
    llama = {(row[2], row[4]): row for row in bound if row[:2] == ["Llama-7B", "shape"]}
    assert len(tiny) == 4 and all(row[-1] == "never" for row in tiny)  # the embedding is most of the tiny model
    assert len(llama) == 4 and all(row[3] == "96.1%" for row in llama.values())
    assert float(llama["float32", "60%"][-2]) < float(llama["bfloat16", "60%"][-2]) < 0.5  # 0.5x met at 60%
    assert 0.5 < float(llama["bfloat16", "60%"][-1].rstrip("%")) / 100 < 0.6


def test_bound_alone(benchmark_script, capsys):
    script = benchmark_script("sparse_inference")
    script.main(["--quick", "--bound"])
    out = capsys.readouterr().out
    assert "(a) one layer" not in out and "(d) checkpoint size" not in out
    _check_bound_section(out)


def test_magnitude_pruning_helper(benchmark_script):
    import torch

    script = benchmark_script("sparse_inference")
    weight = torch.tensor([[1.0, -4.0, 0.5, 3.0, -2.0], [5.0, 1.0, -1.5, 0.1, 2.0]])
    script.magnitude_prune_(weight, 0.6)
    assert weight.tolist() == [[0.0, -4.0, 0.0, 3.0, 0.0], [5.0, 0.0, 0.0, 0.0, 2.0]]


def test_decode_breakdown_splits_a_token_and_removes_its_hooks(benchmark_script):
    import torch

    from sparseswaps_prune.llm.models import tiny_model

    script = benchmark_script("sparse_inference")
    model = tiny_model("llama", seed=0)
    ms = script.decode_breakdown(model, torch.tensor([[1, 5, 7, 9]]), 4)
    assert set(ms) == {"linears", "lm_head", "other"}
    assert ms["linears"] > 0 and ms["lm_head"] > 0 and ms["other"] > 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
