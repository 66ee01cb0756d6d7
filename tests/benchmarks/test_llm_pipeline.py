"""The pipeline benchmark (benchmarks/llm_pipeline.py) runs on a tiny model in seconds and reports sane rows."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("llm_pipeline")


def test_tiny_run_prints_and_writes_rows(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--model", "tiny", "--iters", "0", "2", "--nsamples", "2", "--seqlen", "32", "--device", "cpu"]
    returned = bench.main([*args, "--json", str(out)])
    printed = capsys.readouterr().out
    assert "extrapolation factor 1.0" in printed and "'full model s' is measured" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["iters"] for r in rows] == [0, 2] == [r["iters"] for r in returned]
    t0, t2 = rows
    assert t0["n_swaps"] == 0 and t0["seconds_per_iter"] is None and t0["mean_layer_reduction"] == 0
    assert t2["n_swaps"] > 0 and t2["mean_layer_reduction"] >= 0 and t2["seconds_per_iter"] >= 0
    assert t2["loss_refined"] <= t2["loss_start"]
    for row in rows:
        assert row["blocks_run"] == row["blocks_total"] == 2 and not row["extrapolated"]
        assert len(row["blocks"]) == 2 and row["peak_memory_bytes"] > 0
        assert row["full_model_seconds"] == pytest.approx(row["capture_seconds"] + 2 * row["mean_block_seconds"])
    # every run starts from the same dense weights: block 0 sees the same inputs and start mask in both runs
    assert t2["blocks"][0]["loss_start"] == pytest.approx(t0["blocks"][0]["loss_start"], rel=1e-9)
    table = [line.split() for line in printed.splitlines() if line.split()[:1] in (["0"], ["2"])]
    assert [line[0] for line in table] == ["0", "2"] and table[0][5] == "-" and table[0][6] == "0"


def test_extrapolates_from_the_blocks_run(bench, capsys):
    rows = bench.main(["--model", "tiny", "--blocks", "1", "--iters", "1", "--nsamples", "2", "--seqlen", "16"])
    printed = capsys.readouterr().out
    assert "EXTRAPOLATED from 1 of 2 blocks" in printed and "extrapolation factor 2.0" in printed
    (row,) = rows
    assert row["blocks_run"] == 1 and row["blocks_total"] == 2 and row["extrapolated"]
    assert row["full_model_seconds"] == pytest.approx(row["capture_seconds"] + 2 * row["mean_block_seconds"])
    assert "includes the start mask" in printed  # no T=0 run to subtract


def test_a_recipe_that_does_not_swap_runs_once(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--model", "tiny", "--recipe", "best", "--nsamples", "2", "--seqlen", "16", "--device", "cpu"]
    (row,) = bench.main([*args, "--block-tune-epochs", "1", "--json", str(out)])  # --iters' 5 values ignored
    assert "--recipe best: 60% per layer: alps -> none -> start" in capsys.readouterr().out
    assert row["iters"] == 0 and row["n_swaps"] == 0 and row["loss_refined"] == row["loss_start"]
    assert json.loads(out.read_text())["setup"]["spec"]["start"]["kind"] == "alps"
    (swaps,) = bench.main(["--model", "tiny", "--recipe", "sparseswaps-refit", "--iters", "2", *args[4:]])
    assert swaps["iters"] == 2 and swaps["loss_refined"] <= swaps["loss_start"]


def test_llama_configs_match_the_real_models(bench):
    from transformers import AutoModelForCausalLM

    # parameter counts of meta-llama/Llama-3.1-8B and -70B
    assert bench._llama_params(bench.LLAMA_CONFIGS["llama-3.1-8b"])[0] == 8_030_261_248
    assert bench._llama_params(bench.LLAMA_CONFIGS["llama-3.1-70b"])[0] == 70_553_706_496
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(bench.llama_config("llama-3.1-8b", num_hidden_layers=1))
    assert sum(p.numel() for p in model.parameters()) == bench._llama_params(bench.LLAMA_CONFIGS["llama-3.1-8b"], 1)[0]
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["rope_theta"] == 500000.0


def test_memory_plan(bench, capsys):
    items, _ = bench.memory_plan("llama-3.1-8b")
    assert items["grams"][2] == 4 * (3 * 4096**2 + 14336**2)  # down_proj's 14336-wide Gram is 0.82 GB
    assert items["block"][2] == pytest.approx(0.436e9, rel=0.01)
    items, _ = bench.memory_plan("llama-3.1-70b")
    assert items["block"][2] == pytest.approx(1.711e9, rel=0.01)
    assert items["inputs"][2] == 128 * 2048 * 8192 * 2
    bench.main(["--memory-plan", "llama-3.1-70b"])
    printed = capsys.readouterr().out
    assert "estimated peak (device)" in printed and "estimated peak (host)" in printed


def test_counts_masked_weights_left_behind_by_module_to(bench):
    from torch.nn.utils import prune

    layer = torch.nn.Linear(8, 4)
    prune.custom_from_mask(layer, "weight", torch.ones(4, 8))
    assert bench._stale_device_bytes(layer) == 0
    layer.to("meta")  # as blocks[i].to("cpu") after a GPU block: weight_orig/weight_mask move, weight does not
    assert layer.weight_orig.device.type == "meta" and layer.weight.device.type == "cpu"
    assert bench._stale_device_bytes(layer) == 4 * 8 * 4


def test_marginal_iteration_cost_from_the_smallest_t(bench):
    """Without a T=0 run the figure is per layer (time - its smallest-T time) / extra iterations, summed."""

    def row(iters, layers):
        return {"iters": iters, "layers": [{"name": n, "seconds": s, "iters": i} for n, s, i in layers]}

    rows = [row(1, [("a", 3.0, 1), ("b", 2.0, 1)]), row(9, [("a", 7.0, 9), ("b", 2.5, 3)])]
    bench.add_per_iteration(rows)
    assert "seconds_per_iter" not in rows[0]
    assert rows[1]["seconds_per_iter"] == pytest.approx(4.0 / 8 + 0.5 / 2)
    assert rows[1]["per_iter_base"] == 1 and rows[1]["per_iter_includes_start"] is False


def test_refit_objective_run_keeps_its_refitted_weights(bench, capsys):
    rows = bench.main(
        ["--model", "tiny", "--iters", "0", "2", "--nsamples", "2", "--seqlen", "16", "--objective", "refit"]
    )
    assert "refit objective" in capsys.readouterr().out
    assert rows[1]["n_swaps"] > 0 and rows[1]["seconds_per_iter"] >= 0
