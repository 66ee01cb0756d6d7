"""Helpers shared by the benchmark scripts (``import common``: a script's own directory is on ``sys.path``).

No benchmark imports another benchmark; what more than one of them needs lives here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import refit_engine_class
from sparseswaps_prune.core.backends.gram_gather import gather_gram
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.refine import Figures
from sparseswaps_prune.core.refit import REFIT_DAMP, damping, factor_kept
from sparseswaps_prune.core.spec import DSnoTRefine, PruneSpec, SwapRefine, build_spec
from sparseswaps_prune.core.warmstart import warmstart_mask
from sparseswaps_prune.llm.block_tune import BLOCK_TUNE_LR, BLOCK_TUNE_SCHEDULE
from sparseswaps_prune.llm.data import load_calibration, load_eval_tokens
from sparseswaps_prune.llm.experiment import Experiment
from sparseswaps_prune.llm.job import JobConfig
from sparseswaps_prune.llm.models import load_model
from sparseswaps_prune.llm.pipeline import PruneOptions
from sparseswaps_prune.llm.tasks import write_builtin_cloze_task
from sparseswaps_prune.modules import find_blocks, find_layers, input_hooks
from sparseswaps_prune.recipes import DEFAULT_RECIPE, RECIPES, recipe_name

Grams = dict[str, dict[str, GramAccumulator]]  # layer name -> {"small", "large", "holdout"}


def pattern_options(pattern: str) -> dict[str, Any]:
    """``"60%"`` -> ``{"sparsity": 0.6, "nm": None}``; ``"2:4"`` -> ``{"sparsity": None, "nm": (2, 4)}``."""
    if ":" in pattern:
        n, m = (int(v) for v in pattern.split(":"))
        return {"sparsity": None, "nm": (n, m)}
    return {"sparsity": float(pattern.rstrip("%")) / 100, "nm": None}


def random_layer(
    d_in: int, rows: int, pattern: str = "60%", seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random correlated layer for the speed benchmarks: ``[rows, d_in]`` weights and the ``[d_in, d_in]`` Gram of
    ``4 d_in`` correlated tokens (drawn in float32, then cast to ``dtype``), and the ``[rows, d_in]`` bool Wanda mask of
    ``pattern`` (``"60%"``, ``"2:4"``) computed in ``dtype``. CPU tensors."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(d_in, d_in, generator=gen) / d_in**0.5 + torch.eye(d_in)
    x = torch.randn(4 * d_in, d_in, generator=gen) @ mixing * torch.rand(d_in, generator=gen).add(0.1)
    gram = (x.T @ x).to(dtype)
    weight = torch.randn(rows, d_in, generator=gen).to(dtype)
    return weight, gram, warmstart_mask(weight, "wanda", gram=gram, **pattern_options(pattern))


def triton_refit_layer(
    d_in: int, rows: int, pattern: str, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor, int | None]:
    """:func:`random_layer` (float64, on ``device``) and the Triton engine's re-fit state of its mask
    (``refit_lazy_triton.TritonRefitState``, with the slot counts it uses) at ``damp = 0.01``: ``(weight, gram, keep,
    state, pivot floor [d_in], N:M block size or None)``. Needs triton."""
    engine = refit_engine_class("triton")
    nm = pattern_options(pattern)["nm"]
    m = nm[1] if nm else None
    weight, gram, keep = (t.to(device) for t in random_layer(d_in, rows, pattern, dtype=torch.float64))
    counts = keep.sum(dim=1)
    k, q = (engine.slot_count(n, d_in) for n in (int(counts.max()), d_in - int(counts.min())))
    lam = damping(gram, 0.01)
    state = engine(weight, keep, gram, lam, k, q, m)
    return weight, gram, keep, state, rs.pivot_floor(gram, lam), m


def iterate_step(
    apply: Callable[[tuple[torch.Tensor, ...]], Any],
    figures_of: Callable[[torch.Tensor], Figures],
    figures: Figures,
    device: torch.device | str,
    host: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """One iteration of a row model's row scope as ``refine.iterate`` runs it: the rows whose best swap lowers the
    loss, chosen on the host from ``figures`` (CPU, updated in place), their moves copied to ``device`` in one
    transfer, ``apply(moves)`` (as ``MaskRows.apply`` and ``RefitRows.apply``), and ``figures_of(moved rows)`` (as
    their ``figures``, on the host); nothing where no row's swap lowers the loss. ``host``: a context for the host's
    own work (e.g. a paused operator count)."""
    with host():
        moved = torch.nonzero(figures.swap_dl < 0).flatten()
        if moved.numel() == 0:  # refine.iterate stops
            return
        handles = torch.stack([moved, figures.swap_a[moved], figures.swap_b[moved]])
    moves = handles.to(device).unbind(0)
    apply(moves)
    scanned = figures_of(moves[0])
    with host():
        figures.update(moved, scanned)


def timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Mean seconds of ``fn()`` over ``repeat`` calls after one warm-up call (compilation), CUDA synchronised."""
    fn()
    cuda_sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    cuda_sync()  # CUDA kernels run asynchronously
    return (time.perf_counter() - start) / repeat


def cuda_sync() -> None:
    """Wait for the queued CUDA kernels (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shared_schur_bound(gram64: torch.Tensor, lam: float) -> torch.Tensor:
    """``[d]`` float64 ``sigma_p = 1 / [(G + lambda I)^-1]_pp``: the Schur complement of input ``p`` against every
    other input. A larger kept set leaves a smaller residual, so ``sigma_p <= s_p`` for every row's kept set, and
    ``dF(u, p) >= -r_p^2 / sigma_p`` is a looser bound that one ``[d, d]`` inverse per layer gives, shared by all
    rows (no row's ``s_p`` needed)."""
    eye = torch.eye(gram64.shape[0], dtype=torch.float64)
    return 1.0 / torch.cholesky_inverse(torch.linalg.cholesky(gram64 + lam * eye)).diagonal()


def bound_visits(
    state: Any, w64: torch.Tensor, rows: torch.Tensor, best: torch.Tensor, schur: torch.Tensor
) -> torch.Tensor:
    """``[n]`` int64: per row of ``rows`` the restorable pruned slots whose bound ``-r_p^2 / schur_p`` does not exceed
    the row's best swap ``best`` (``[n]`` float64): the columns a scan in ascending order of that bound visits before
    it may stop. ``schur``: ``[n, Q]`` per pruned slot, the state's ``s_p`` (the numba engine's bound) or a lower
    bound of it (e.g. :func:`shared_schur_bound` at the slots' inputs). ``state``: a re-fit state
    (``refit_swaps.RefitState`` or the numba engine's), ``w64`` its ``[R, d]`` weights."""
    restorable = rs.restorable(state, w64, rows)
    return (restorable & (-state.resid[rows].square() / schur <= best[:, None])).sum(dim=1)


def lazy_build(
    w64: torch.Tensor, keep: torch.Tensor, gram64: torch.Tensor, lam: float, shared: torch.Tensor, columns: int
) -> tuple[torch.Tensor, ...]:
    """What a re-fit state without every row's ``s_p`` must compute before its first scan (the floor of that design,
    against :func:`refit_swaps.build_state`): the Cholesky factor ``L`` of every row's ``G_SS + lambda I``,
    ``L^-1``, ``H``'s diagonal, ``v = H b_S``, the residuals ``r = b - G v`` of every input (one product with the
    Gram), and for the ``columns`` restorable inputs of smallest ``-r_p^2 / sigma_p`` (``shared``) their ``s_p`` and
    ``Z`` columns. ``w64``, ``keep``: ``[R, d]``; nothing is modified.

    Returns:
        ``H_uu`` and ``v`` ``[R, K]`` (slots of :func:`refit.factor_kept`), ``r`` ``[R, d]`` (meaningful at pruned
        inputs), the chosen inputs ``[R, c]`` int64, their ``s_p`` ``[R, c]`` and ``Z`` columns ``[R, K, c]``.
    """
    kept, kept_ok, factor = factor_kept(gram64, keep, lam, int(keep.sum(dim=1).max()))
    eye = torch.eye(factor.shape[1], dtype=torch.float64).expand_as(factor)
    half = torch.linalg.solve_triangular(factor, eye, upper=False).mul_(kept_ok[:, None, :])  # L^-1, spare slots 0
    hdiag = half.square().sum(dim=1)  # H = L^-T L^-1
    target = w64 @ gram64
    coef = (half.mT @ (half @ torch.where(kept_ok, target.gather(1, kept), 0.0)[:, :, None])).squeeze(2)
    resid = target - torch.zeros_like(w64).scatter_(1, kept, torch.where(kept_ok, coef, 0.0)) @ gram64
    loose = torch.where(~keep & (w64 != 0), -resid.square() / shared, float("inf"))
    inputs = loose.topk(columns, dim=1, largest=False).indices
    cross = gather_gram(gram64, kept, inputs) * kept_ok[:, :, None]  # as build_state
    half_cross = half @ cross  # L^-1 G[S, p]
    schur = torch.diagonal(gram64)[inputs] + lam - half_cross.square().sum(dim=1)
    return hdiag, coef, resid, inputs, schur, half.mT @ half_cross


def add_layer_run_args(parser: argparse.ArgumentParser, blocks: list[int]) -> None:
    """The options of a run over the real layers of ``--blocks`` of the default model: ``--pattern``, ``--iters``,
    ``--nsamples`` calibration windows of ``--seqlen`` tokens and the re-fit's ``--damp``."""
    parser.add_argument("--blocks", type=int, nargs="+", default=blocks)
    parser.add_argument("--pattern", default="60%", help="e.g. 60%% or 2:4")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--nsamples", type=int, default=16, help="calibration windows")
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--damp", type=float, default=REFIT_DAMP)


def capture_grams(blocks: list[int], small: int, large: int, holdout: int, seqlen: int) -> tuple[dict, Grams]:
    """Dense weights ``{name: [d_out, d_in]}`` and three Grams of every linear layer of ``blocks`` of the default
    model, from one dense forward over built-in calibration windows: ``"small"`` (the first ``small`` windows),
    ``"large"`` (all ``large`` windows, the small ones included) and ``"holdout"`` (``holdout`` windows whose
    tokens lie outside every calibration window)."""
    model, tokenizer = load_model()
    windows = load_calibration("builtin", tokenizer, large, seqlen, seed=0, holdout=holdout)
    prefix, block_list = find_blocks(model)
    layers = [layer for b in blocks for layer in find_layers(block_list[b], prefix=f"{prefix}.{b}")]
    grams: Grams = {
        layer.name: {part: GramAccumulator(layer.d_in, dtype=torch.float64) for part in ("small", "large", "holdout")}
        for layer in layers
    }
    part = "small"

    def record(name: str, x: torch.Tensor) -> None:
        grams[name][part].add(x)
        if part == "small":
            grams[name]["large"].add(x)

    with torch.no_grad(), input_hooks(layers, record):
        for i, window in enumerate(windows):
            part = "small" if i < small else "large" if i < large else "holdout"
            model(window[None])
    weights = {layer.name: layer.weight_2d().detach().clone() for layer in layers}
    return weights, grams


_DEFAULT_TUNE = RECIPES[DEFAULT_RECIPE].block_tune_epochs
SETTING_BASE = "sparseswaps-refit"
"""The recipe a setting's options change unless it names one (``recipe=...``): ``RECIPES["sparseswaps-refit"]``
(Wanda, SparseSwaps T=10, least-squares re-fit), the spec every setting of RESULTS.md was written against."""


def _recipe(name: str) -> str:
    return recipe_name(name)  # a renamed recipe ("default": "best") warns


# setting option (--extra) -> parser of its value (the recipe, the build_spec options, dsnot_skip, the pipeline's)
_OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "recipe": _recipe,
    "start": str,
    "start_damp": float,
    "scope": str,
    "refine": str,
    "max_iters": int,
    "eps": float,
    "objective": str,
    "search_dtype": str,
    "backend": str,
    "swap_scope": str,
    "weights": str,
    "damp": float,
    "ridge": str,
    "guard": lambda v: {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[v.lower()],
    "dsnot_skip": lambda v: None if v.lower() == "none" else v,
    "profile": str,
    "owl_m": float,
    "owl_lambda": float,
    "tune": int,
    "tune_lr": float,
    "tune_schedule": str,
}
# setting options that are pipeline options (PruneOptions fields), not a layer's spec: setting name -> field
_PIPELINE_OPTIONS = {
    "profile": "sparsity_profile", "owl_m": "owl_m", "owl_lambda": "owl_lambda", "tune": "block_tune_epochs",
    "tune_lr": "block_tune_lr", "tune_schedule": "block_tune_schedule",
}  # fmt: skip
_WEIGHT_NAMES = {"start": "start weights", "admm_update": "admm update", "alps_update": "alps update"}


def parse_shape(text: str, option: str = "--shapes") -> tuple[int, int]:
    """``"576x1536"`` (or ``"576X1536"``) -> ``(576, 1536)``: a weight's output and input features.

    Raises:
        SystemExit: not two positive integers joined by ``x``, naming ``option``.
    """
    out, sep, inp = text.lower().partition("x")
    if not (sep and out.isdigit() and inp.isdigit() and int(out) > 0 and int(inp) > 0):
        raise SystemExit(f"{option}: {text!r} is not OUTxIN with two positive integers (e.g. 576x1536)")
    return int(out), int(inp)


def parse_setting(text: str) -> dict[str, Any]:
    """``"start=admm,refine=none,max_iters=5"`` -> ``{"start": "admm", "refine": "none", "max_iters": 5}``;
    ``""`` -> ``{}`` (:data:`SETTING_BASE`'s recipe, without block tuning); ``"recipe=alps"`` -> ``{"recipe":
    "alps"}`` (that recipe's spec as the base); ``"default"`` -> ``{"recipe": "best", "tune": E}`` with ``E`` that
    recipe's block-tuning epochs: the CLI's default recipe with its block tuning (``PruneOptions()``; the recipe's
    fine-tune is the job's, ``prune_finetune.py`` runs it)."""
    setting: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item == "default":
            setting.setdefault("recipe", DEFAULT_RECIPE)
            setting.setdefault("tune", _DEFAULT_TUNE)
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"setting {text!r}: {item!r} is not OPTION=VALUE")
        if key in ("sparsity", "nm"):
            raise SystemExit(f"setting {text!r}: the budget comes from --patterns, not {key}=")
        if key not in _OPTION_TYPES:
            raise SystemExit(f"setting {text!r}: unknown option {key!r}; known: {', '.join(_OPTION_TYPES)}")
        try:
            setting[key] = _OPTION_TYPES[key](value)
        except (KeyError, ValueError):
            raise SystemExit(f"setting {text!r}: bad value {value!r} for {key}") from None
    return setting


def layer_setting(text: str) -> dict[str, Any]:
    """:func:`parse_setting` for scripts that prune single layers: ``"default"`` is the default recipe's layer spec
    there (its block tuning is a pipeline stage, not a layer's)."""
    setting = parse_setting(text)
    if "default" in (part.strip() for part in text.split(",")) and setting.get("tune") == _DEFAULT_TUNE:
        del setting["tune"]
    return setting


def setting_spec(setting: dict[str, Any], pattern: str, max_iters: int) -> PruneSpec:
    """The spec of one setting at one pattern: its recipe (``RECIPES[setting["recipe"]].spec``, default
    :data:`SETTING_BASE`'s) with the pattern's budget (N:M selects per row), then ``setting``'s other options
    (``scope="layer"`` dropped at N:M), then T=``max_iters`` unless the setting gives ``max_iters`` or a recipe."""
    pipeline = sorted(setting.keys() & _PIPELINE_OPTIONS.keys())
    if pipeline:
        raise ValueError(
            f"{', '.join(pipeline)} set the pipeline's block budgets (PruneOptions), not a layer's spec; they apply to "
            "the whole-model runs of compare_methods.py only"
        )
    budget = pattern_options(pattern)
    options = dict(setting)
    skip = options.pop("dsnot_skip", "unset")
    recipe = options.pop("recipe", None)
    if budget["nm"] is not None and options.get("scope") == "layer":
        del options["scope"]
    spec = build_spec(build_spec(RECIPES[recipe or SETTING_BASE].spec, **budget), **options)
    if isinstance(spec.refine, SwapRefine) and "max_iters" not in options and recipe is None:
        spec = dataclasses.replace(spec, refine=dataclasses.replace(spec.refine, max_iters=max_iters))
    if skip != "unset":
        if not isinstance(spec.refine, DSnoTRefine):
            raise ValueError(f"dsnot_skip is an option of refine='dsnot', but refine is {spec.refine.name!r}")
        spec = dataclasses.replace(spec, refine=dataclasses.replace(spec.refine, skip=skip))
    return spec


def setting_options(setting: dict[str, Any], pattern: str, max_iters: int) -> PruneOptions:
    """The pipeline options of one setting at one pattern: :func:`setting_spec` of its spec options, and its
    pipeline options (``profile``: ``PruneOptions.sparsity_profile``, ``owl_m``, ``owl_lambda``; ``tune``:
    ``block_tune_epochs``, 0 unless given, ``tune_lr``: ``block_tune_lr``, ``tune_schedule``: ``block_tune_schedule``),
    validated."""
    fields = {"block_tune_epochs": 0}
    fields |= {_PIPELINE_OPTIONS[key]: value for key, value in setting.items() if key in _PIPELINE_OPTIONS}
    spec = setting_spec({k: v for k, v in setting.items() if k not in _PIPELINE_OPTIONS}, pattern, max_iters)
    options = PruneOptions(spec=spec, **fields)  # recipe "best": rows saved before recipes existed stay readable
    options.validate()
    return options


def _changed(stage: Any, skip: tuple[str, ...] = ()) -> str:
    """`` name value`` for every field of ``stage`` that differs from its class default (``skip`` left out)."""
    default = type(stage)()
    parts = []
    for f in dataclasses.fields(stage):
        value = getattr(stage, f.name)
        if f.name in skip or value == getattr(default, f.name):
            continue
        parts.append(f" {f.name} {value:g}" if isinstance(value, float) else f" {f.name} {value}")
    return "".join(parts)


def label(spec: PruneSpec) -> str:
    """The stages of ``spec`` (its budget aside), e.g. ``admm/layer -> none -> start weights`` or
    ``wanda -> sparseswaps T=25 -> ls (guarded)``; every stage option off its default is named."""
    start = spec.start.name + ("/layer" if spec.budget.scope == "layer" else "") + _changed(spec.start, ("score",))
    refine = spec.refine
    if isinstance(refine, SwapRefine):
        text = f"sparseswaps T={refine.max_iters}" + (" (refit objective)" if refine.objective == "refit" else "")
        text += _changed(refine, skip=("max_iters", "objective"))
    elif isinstance(refine, DSnoTRefine):
        text = "dsnot" + (" (all layers)" if refine.skip is None else "") + _changed(refine, skip=("skip",))
        if refine.skip not in (None, DSnoTRefine().skip):
            text += f" (skips {refine.skip})"
    else:
        text = refine.name
    weights = spec.weights
    guarded = getattr(weights, "guard", False)
    weight_text = _WEIGHT_NAMES.get(weights.kind, weights.name) + _changed(weights, skip=("guard", "solver"))
    return f"{start} -> {text} -> {weight_text}" + (" (guarded)" if guarded else "")


def options_label(options: PruneOptions) -> str:
    """:func:`label` of the spec, block tuning and a non-uniform block profile, e.g. ``wanda -> ... -> ls -> block tune
    10``, ``wanda -> ... -> ls, owl M=5 lambda=0.08``."""
    text = label(options.spec)
    if options.block_tune_epochs:
        text += f" -> block tune {options.block_tune_epochs}"
        text += "" if options.block_tune_lr == BLOCK_TUNE_LR else f" lr {options.block_tune_lr:g}"
        text += "" if options.block_tune_schedule == BLOCK_TUNE_SCHEDULE else f" {options.block_tune_schedule}"
    if options.sparsity_profile == "uniform":
        return text
    return f"{text}, {options.sparsity_profile} M={options.owl_m:g} lambda={options.owl_lambda:g}"


def row_path(out: Path, pattern: str, options: PruneOptions) -> Path:
    """``--out``/``60__wanda__sparseswaps_T=25__ls_guarded.json``: the pattern and the label, file-name safe."""
    text = options_label(options).replace(" -> ", "__").replace("/", "-")
    name = f"{pattern.replace(':', 'of').rstrip('%')}__{text}"
    return out / f"{re.sub(r'[^A-Za-z0-9_.=+-]+', '_', name).strip('_')}.json"


def add_experiment_args(parser: argparse.ArgumentParser) -> None:
    """The data options of a whole-model run on the default model (:func:`default_experiment`): ``--nsamples``
    calibration and ``--holdout`` held-out windows of ``--seqlen`` tokens, at most ``--eval-windows`` perplexity
    windows of each evaluation text (``--extra-eval`` beside the built-in one), ``--device``; the main job's
    defaults (:class:`~sparseswaps_prune.llm.job.JobConfig`)."""
    parser.add_argument("--nsamples", type=int, default=JobConfig.nsamples, help="calibration windows (the job's)")
    parser.add_argument("--holdout", type=int, default=JobConfig.holdout, help="held-out calibration windows")
    parser.add_argument("--seqlen", type=int, default=JobConfig.seqlen)
    parser.add_argument("--eval-windows", type=int, default=JobConfig.eval_windows)
    parser.add_argument(
        "--extra-eval",
        nargs="*",
        default=["stdlib-prose"],
        help="more evaluation texts (data sources) for perplexity beside the built-in one (default: stdlib-prose, "
        "English prose calibration never touches)",
    )
    parser.add_argument("--device", default="cpu")


def default_experiment(args: argparse.Namespace, cloze_items: int = 0) -> Experiment:
    """The default model with the built-in data of ``args`` (:func:`add_experiment_args`): the first ``--nsamples``
    of ``load_calibration("builtin", tokenizer, nsamples, seqlen, seed=0, holdout=holdout)`` as calibration windows,
    the ``--holdout`` after them as held-out windows, ``load_eval_tokens`` of ``"builtin"`` (the evaluation part of
    the built-in corpus) and of each ``--extra-eval`` text, and ``cloze_items`` ``builtin_cloze`` items for zero-shot
    accuracy (0: none)."""
    model, tokenizer = load_model()
    windows = load_calibration("builtin", tokenizer, args.nsamples, args.seqlen, seed=0, holdout=args.holdout)
    task_dir = tempfile.mkdtemp(prefix="sparseswaps_tasks_") if cloze_items else None
    tasks = [write_builtin_cloze_task(task_dir, n_items=cloze_items)] if task_dir else None
    return Experiment(
        model,
        tokenizer,
        windows[: args.nsamples],
        holdout_tokens=windows[args.nsamples :] if args.holdout else None,
        eval_tokens=load_eval_tokens("builtin", tokenizer),
        extra_eval_tokens={name: load_eval_tokens(name, tokenizer) for name in args.extra_eval},
        seqlen=args.seqlen,
        eval_windows=args.eval_windows,
        tasks=tasks,
        include_path=task_dir,
        device=args.device,
    )


def import_file(path: str, name: str) -> ModuleType:
    """The Python file ``path`` imported as a module called ``name`` (registered in ``sys.modules``, where numba's
    cache and dataclasses look their module up), e.g. another version of a package module for an A/B timing."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def median_seconds(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of ``repeats`` calls of each of ``fns`` after one warm-up call each; the calls are
    interleaved (``f0, f1, f2, f0, ...``) so that a change in the machine's load hits them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]
