"""Time ``load_model()`` (the packaged SmolLM2 GGUF: config, weights and tokenizer) with and without
``gguf_parsed_once``, each load in a fresh Python process, the two alternating; prints every load and the medians,
and checks that both give the same tensors and token ids.

    python benchmarks/load_time.py [PAIRS]      # default 3 pairs

``once``: ``load_model()`` as it is (one parse of the GGUF, the tensor-name map built once). ``thrice``: the same
``load_model()`` with ``gguf_parsed_once`` replaced by a block that does nothing, so transformers parses the file
three times and builds the name map per submodule, as it did before.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys

_CHILD = r"""
import contextlib, hashlib, json, sys, time
import torch
from sparseswaps_prune.llm import models
if sys.argv[1] == "thrice":
    models.gguf_parsed_once = contextlib.nullcontext
start = time.perf_counter()
model, tokenizer = models.load_model()
seconds = time.perf_counter() - start
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
digest.update(json.dumps(tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]).encode())
print(json.dumps({"seconds": seconds, "digest": digest.hexdigest()[:16]}))
"""


def _load(variant: str) -> dict:
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, variant], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} load failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    pairs = int(argv[0]) if argv else 3
    print(f"machine: {platform.platform()} | {os.cpu_count()} CPUs | load average {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {"once": [], "thrice": []}
    for pair in range(pairs):
        for variant in ("thrice", "once") if pair % 2 else ("once", "thrice"):
            runs[variant].append(_load(variant))
            print(f"pair {pair}: {variant:6s} {runs[variant][-1]['seconds']:.1f} s", flush=True)
    digests = {run["digest"] for variant in runs.values() for run in variant}
    medians = {name: statistics.median(run["seconds"] for run in variant) for name, variant in runs.items()}
    same = "yes" if len(digests) == 1 else "NO"
    print(
        f"load_model(): once {medians['once']:.1f} s, thrice {medians['thrice']:.1f} s (median of {pairs}; "
        f"{medians['thrice'] / medians['once']:.2f}x); same tensors and token ids: {same}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
