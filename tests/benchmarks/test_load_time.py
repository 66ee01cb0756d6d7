"""benchmarks/load_time.py: alternates the two variants, prints their medians, and says when the loads differ."""

from __future__ import annotations


def test_alternates_variants_and_flags_a_different_load(benchmark_script, capsys, monkeypatch):
    bench = benchmark_script("load_time")
    order, seconds = [], {"once": iter([4.0, 6.0, 5.0]), "thrice": iter([12.0, 9.0, 10.0])}

    def load(variant):
        order.append(variant)
        return {"seconds": next(seconds[variant]), "digest": "a"}

    monkeypatch.setattr(bench, "_load", load)
    bench.main(["3"])
    assert order == ["once", "thrice", "thrice", "once", "once", "thrice"]  # alternating which goes first
    assert capsys.readouterr().out.splitlines()[-1] == (
        "load_model(): once 5.0 s, thrice 10.0 s (median of 3; 2.00x); same tensors and token ids: yes"
    )
    digests = iter(["a", "b"])
    monkeypatch.setattr(bench, "_load", lambda variant: {"seconds": 1.0, "digest": next(digests)})
    bench.main(["1"])
    assert capsys.readouterr().out.splitlines()[-1].endswith("same tensors and token ids: NO")
