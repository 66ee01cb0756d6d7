"""SHA-256 digest of a saved model's tensors, to check that two runs saved bit-identical weights.

    python benchmarks/weights_digest.py OUT_DIR [OUT_DIR ...]

Prints one line per directory: the first 16 hex digits of the SHA-256 over every ``*.safetensors`` file's
tensors (sorted by file, then by tensor name; name, dtype, shape and raw bytes), then the directory. Metadata
and file layout (sharding) do not enter, so a sharded and a single-file save of the same tensors agree.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights_digest(out_dir: str | Path) -> str:
    """First 16 hex digits of the SHA-256 over all tensors of ``out_dir/*.safetensors``."""
    files = sorted(Path(out_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{out_dir}: no *.safetensors files; pass a directory written by save_pretrained")
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", help="directories written by save_pretrained")
    for out_dir in parser.parse_args().dirs:
        print(weights_digest(out_dir), out_dir)


if __name__ == "__main__":
    main()
