"""How one layer is pruned: :class:`PruneSpec` (a budget and one stage of each role) and :func:`build_spec`, which
maps the flat option names that the CLI, the prune method and the callback share onto the stages.

The stages themselves, each doing its own work behind its role's one method, are in
:mod:`~sparseswaps_prune.core.stages` (and importable from here):

* **start** (a mask): :class:`ScoreStart` (magnitude | wanda | ria scores, then selection),
  :class:`SparseGPTStart` (SparseGPT's mask), :class:`ADMMStart` (Boza 2024) or :class:`ALPSStart` (Meng et al.
  2024); the last three also compute weights for their mask, which :class:`StartWeights` keeps;
* **refine** (the mask): :class:`SwapRefine` (SparseSwaps, under the mask or the re-fit objective),
  :class:`DSnoTRefine` or :class:`NoRefine`;
* **weights** (the final kept weights): :class:`KeepWeights`, :class:`LeastSquares` (exact per-row re-fit, direct
  or conjugate-gradient solver), :class:`OBSUpdate` (SparseGPT's update on the final mask), :class:`ADMMUpdate`
  or :class:`ALPSUpdate` (their updates on the final mask) or :class:`StartWeights`; a weight update may be
  guarded by held-out calibration windows (a row keeps its update only where it lowers that row's held-out
  loss).

A spec is validated when it is built: every stage checks its own fields, then what it needs of the other stages
(e.g. ``SwapRefine(objective="refit")`` needs ``LeastSquares`` weights).

``PruneSpec()`` is :data:`SPARSESWAPS_SPEC`, SparseSwaps masks only (ADMM's mask, 25 swap iterations, weights kept):
what the namesake entry points run with no spec. The named methods (the CLI's ``best`` default: ALPS's solution,
then block tuning; the published baselines) are recipes (:mod:`sparseswaps_prune.recipes`).

Example:
    >>> spec = build_spec(nm=(2, 4))                        # SparseSwaps masks only, 2:4
    >>> spec = build_spec(max_iters=50, weights="ls")       # ADMM's mask -> SparseSwaps T=50 -> least-squares re-fit
    >>> spec = PruneSpec(budget=Budget(sparsity=0.5), start=SparseGPTStart(), refine=NoRefine(),
    ...                  weights=OBSUpdate())                  # SparseGPT as published (with scope="layer")
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from sparseswaps_prune.core.checks import check_choice
from sparseswaps_prune.core.stages import (
    OBJECTIVES,
    REFINE_STAGES,
    SCOPES,
    SCORES,
    SEARCH_BACKENDS,
    START_STAGES,
    WEIGHT_STAGES,
    WEIGHT_STARTS,
    ADMMStart,
    ADMMUpdate,
    ALPSStart,
    ALPSUpdate,
    Budget,
    DSnoTRefine,
    KeepWeights,
    LeastSquares,
    NoRefine,
    OBSUpdate,
    RefineStage,
    ScoreStart,
    SparseGPTStart,
    Stage,
    StartStage,
    StartWeights,
    SwapRefine,
    WeightStage,
    stage_names,
)

__all__ = [
    "OBJECTIVES", "REFINES", "RENAMED_OPTIONS", "SCOPES", "SCORES", "SEARCH_BACKENDS", "SPARSESWAPS_SPEC",
    "SPEC_OPTIONS", "STARTS", "WEIGHTS", "WEIGHT_STARTS", "ADMMStart", "ADMMUpdate", "ALPSStart", "ALPSUpdate",
    "Budget", "DSnoTRefine", "KeepWeights", "LeastSquares", "NoRefine", "OBSUpdate", "PruneSpec", "Refine",
    "ScoreStart", "SparseGPTStart", "Start", "StartWeights", "SwapRefine", "Weights", "build_spec",
]  # fmt: skip

STARTS = stage_names(START_STAGES)
"""The ``start`` option's values: ``magnitude``, ``wanda``, ``ria``, ``sparsegpt``, ``admm``, ``alps``."""
REFINES = stage_names(REFINE_STAGES)
"""The ``refine`` option's values: ``sparseswaps``, ``dsnot``, ``none``."""
WEIGHTS = stage_names(WEIGHT_STAGES)
"""The ``weights`` option's values: ``keep``, ``ls``, ``cg``, ``obs``, ``admm``, ``alps``, ``start``."""

Start = StartStage
Refine = RefineStage
Weights = WeightStage
_ROLES: dict[str, tuple[type[Stage], tuple[type[Stage], ...]]] = {
    "start": (StartStage, START_STAGES),
    "refine": (RefineStage, REFINE_STAGES),
    "weights": (WeightStage, WEIGHT_STAGES),
}


def _options_of(options: dict[str, Any]) -> str:
    """``"max_iters is an option of"`` / ``"max_iters, eps are options of"``."""
    return f"{', '.join(options)} {'is an option' if len(options) == 1 else 'are options'} of"


def _by_name(value: str, option: str, table: tuple[type[Stage], ...]) -> Stage:
    """The stage of ``table`` that option value ``value`` names, with its defaults."""
    check_choice(value, option, stage_names(table))
    return next(cls for cls in table if value in cls.names).from_name(value)


@dataclass(frozen=True)
class PruneSpec:
    """How one layer is pruned: budget, start, refine, weights (see the module docstring). With no arguments, every
    stage's own defaults: SparseSwaps masks only, 60% per row, ADMM's mask (its weights discarded), 25 exact 1-swap
    iterations (mask objective), the kept weights as they are (:data:`SPARSESWAPS_SPEC`).

    Any :class:`~sparseswaps_prune.core.stages.StartStage`, :class:`~sparseswaps_prune.core.stages.RefineStage` and
    :class:`~sparseswaps_prune.core.stages.WeightStage` fit (``prune_layer`` only calls their methods); JSON
    (:meth:`from_dict`) knows the built-in ones.

    Raises ``TypeError``/``ValueError`` naming the stage and the fix when built with a stage of the wrong type or
    a combination that means nothing (e.g. ``SwapRefine(objective="refit")`` without ``LeastSquares`` weights).
    """

    budget: Budget = field(default_factory=lambda: Budget(sparsity=0.6))
    start: StartStage = field(default_factory=ADMMStart)
    refine: RefineStage = field(default_factory=SwapRefine)
    weights: WeightStage = field(default_factory=KeepWeights)

    def __post_init__(self) -> None:
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be a Budget, got {type(self.budget).__name__}")
        for role, (base, table) in _ROLES.items():
            value = getattr(self, role)
            if not isinstance(value, base):
                raise TypeError(
                    f"{role} must be one of {', '.join(t.__name__ for t in table)} (or another {base.__name__}); got "
                    f"{type(value).__name__}"
                )
        for stage in self.stages:
            stage.check(self)

    @property
    def stages(self) -> tuple[StartStage, RefineStage, WeightStage]:
        """``(start, refine, weights)``."""
        return self.start, self.refine, self.weights

    @property
    def updates_weights(self) -> bool:
        """True if the final kept weights differ from the original ones (a re-fit or OBS update)."""
        return self.weights.updates_weights

    @property
    def row_obstacle(self) -> str | None:
        """Why the rows of a layer cannot be pruned apart (None: they can, :attr:`row_separable`): the first
        stage's :attr:`~sparseswaps_prune.core.stages.Stage.row_obstacle`."""
        if self.budget.scope != "row":
            return "a per-layer budget (scope='layer') selects weights across rows"
        return next((why for why in (stage.row_obstacle for stage in self.stages) if why is not None), None)

    @property
    def row_separable(self) -> bool:
        """True when every stage treats each output row on its own, so that :func:`~sparseswaps_prune.core.layer.
        prune_layer` on a slice of rows gives those rows of the whole layer's outcome (the distributed pipeline's
        row shards, ``PruneOptions.row_shards``): a per-row or N:M budget, a magnitude or Wanda start, any
        refinement (SparseSwaps then swaps within rows; DSnoT is per row) and kept or least-squares weights (direct
        or CG, guarded or not). Not separable: per-layer budgets, RIA (column sums), and the SparseGPT, ADMM and
        ALPS starts and updates. Equal bits also need the BLAS to round each row's products independently of how
        many rows are multiplied together (see :mod:`~sparseswaps_prune.llm.distributed`)."""
        return self.row_obstacle is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; each stage carries its ``kind`` (``PruneSpec.from_dict`` inverts it)."""
        out: dict[str, Any] = {"budget": dataclasses.asdict(self.budget)}
        for role in _ROLES:
            value = getattr(self, role)
            out[role] = {"kind": value.kind, **dataclasses.asdict(value)}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruneSpec:
        """The spec ``to_dict`` wrote (unknown kinds or fields raise ``ValueError``)."""
        stages = {}
        for role, (_, table) in _ROLES.items():
            fields_ = dict(data[role])
            kind = fields_.pop("kind")
            by_kind = {t.kind: t for t in table}
            if kind not in by_kind:
                raise ValueError(f"unknown {role} kind {kind!r}; expected one of {', '.join(by_kind)}")
            try:
                stages[role] = by_kind[kind](**fields_)
            except TypeError as err:
                raise ValueError(f"{role}: {err}") from None
        budget = dict(data["budget"])
        if budget.get("nm") is not None:
            budget["nm"] = tuple(budget["nm"])
        return cls(budget=Budget(**budget), **stages)

    def describe(self) -> str:
        """One line naming every stage, e.g. ``60% per row: wanda -> sparseswaps T=10 (mask) -> ls (diag ridge
        0.1)``."""
        budget = self.budget
        head = f"{budget.nm[0]}:{budget.nm[1]}" if budget.nm else f"{budget.sparsity:.0%} per {budget.scope}"
        return f"{head}: {' -> '.join(stage.describe(budget) for stage in self.stages)}"


SPARSESWAPS_SPEC = PruneSpec()
"""SparseSwaps masks only: 60% per row, ADMM's mask (Boza 2024, per row, its weights discarded), then 25 iterations
of exact, loss-decreasing 1-swaps within rows under the mask objective; the kept weights stay as they are. What the
namesake entry points run with no spec (``prune_layer``, :class:`~sparseswaps_prune.prune.SparseSwapsMethod`,
``sparseswaps_unstructured``, the Lightning callback, ``--recipe sparseswaps``) and ``PruneSpec()``: every stage's
own defaults.

Why this start: of the masks compared on the default model (magnitude, Wanda, RIA, SparseGPT's, ADMM's and ALPS's,
each with and without the swaps; RESULTS.md "Masks only, 64 windows, on two texts"), the swaps from ADMM's mask give
the lowest held-out perplexity at 60%, 70% and 2:4 on the built-in evaluation text (47.35 at 60% against 48.95 from
RIA's mask and 50.51 from Wanda's, the paper's start) and at 60% and 70% on stdlib-prose, text calibration never
touched, at about 1.5x the time of a score start; they stay ahead after a short PERP fine-tune. An already pruned
tensor is pruned again within its mask (iterative pruning through ``torch.nn.utils.prune``; not N:M). ``start="ria"``
is the fast alternative (a score start; seconds for the mask); ``start="wanda"`` is the paper's. ADMM's float32
products are not verified row by row, so the default prunes whole layers where row shards were asked for
(``PruneOptions.row_shards``; ``start="wanda"`` treats rows apart). Why T=25: about 89% of the converged loss
reduction on the default model at a quarter of T=100's time (RESULTS.md "SparseSwaps vs Wanda"), as the paper finds
("values around T=25 often suffice")."""


RENAMED_OPTIONS = {"warmstart": "start", "refit": "weights", "holdout_guard": "guard"}
"""The previous release's option names and their names now (accepted for one release with a warning)."""
SPEC_OPTIONS = (
    "sparsity", "nm", "scope", "start", "start_damp", "refine", "max_iters", "eps", "objective", "search_dtype",
    "backend", "swap_scope", "weights", "damp", "guard", "ridge",
)  # fmt: skip
"""The flat option names :func:`build_spec` takes."""


def build_spec(
    base: PruneSpec = SPARSESWAPS_SPEC,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    scope: str | None = None,
    start: str | None = None,
    start_damp: float | None = None,
    refine: str | None = None,
    max_iters: int | None = None,
    eps: float | None = None,
    objective: str | None = None,
    search_dtype: str | None = None,
    backend: str | None = None,
    swap_scope: str | None = None,
    weights: str | None = None,
    damp: float | None = None,
    guard: bool | None = None,
    ridge: str | None = None,
    **renamed: Any,
) -> PruneSpec:
    """``base`` with the given flat options changed (None = as in ``base``): the option names the CLI, the prune
    method and the Lightning callback share.

    Args:
        sparsity, nm, scope: the budget (``sparsity`` replaces ``nm`` and the other way round; ``nm`` without
            ``scope`` selects per row, whatever ``base``'s scope).
        start: ``"magnitude"``, ``"wanda"``, ``"ria"``, ``"sparsegpt"``, ``"admm"`` or ``"alps"``; ``start_damp``
            (the start's own ridge) needs one of the last three.
        refine: ``"sparseswaps"``, ``"dsnot"`` or ``"none"``; ``max_iters``, ``eps``, ``objective``,
            ``search_dtype``, ``backend``, ``swap_scope`` (``"row"``: :attr:`SwapRefine.scope`) need
            ``"sparseswaps"``.
        weights: ``"keep"``, ``"ls"`` (direct least squares), ``"cg"`` (least squares by conjugate gradients),
            ``"obs"`` (SparseGPT's update), ``"admm"``, ``"alps"`` (their updates on the final mask) or ``"start"``
            (the start's own weights); ``damp`` and ``guard`` need a weight update (``damp`` not with ``"start"``);
            ``ridge`` (``"mean"`` or ``"diag"``, :class:`LeastSquares`) needs ``"ls"`` or ``"cg"``, and a new
            ``ridge`` without ``damp`` takes that ridge's default damp.

        renamed: the previous release's names, accepted with a ``DeprecationWarning`` (:data:`RENAMED_OPTIONS`):
            ``warmstart`` (``start``), ``refit`` (``weights``; ``"none"`` is ``"keep"``), ``holdout_guard``
            (``guard``).

    Raises:
        ValueError: an option that means nothing for the chosen stage (names it and the stage it needs), or any
            error of the stages themselves.
        TypeError: an unknown option, or ``base`` not a :class:`PruneSpec`.

    Example:
        >>> build_spec(weights="keep").weights
        KeepWeights()
    """
    if not isinstance(base, PruneSpec):
        raise TypeError(
            f"base must be a PruneSpec, got {type(base).__name__}; for a named recipe pass its layer spec, "
            "e.g. RECIPES['alps'].spec"
        )
    # the options the previous release named otherwise, under their names now
    current = {"start": start, "weights": weights, "guard": guard}
    for old, value in renamed.items():
        if old not in RENAMED_OPTIONS:
            raise TypeError(f"unknown option {old}={value!r}; the options are {', '.join(SPEC_OPTIONS)}")
        new = RENAMED_OPTIONS[old]
        warnings.warn(f"{old}= is renamed {new}= (it will be removed in the next release)", DeprecationWarning, 3)
        if current[new] is not None:
            raise ValueError(f"give {new}= only (not also its former name {old}=)")
        current[new] = "keep" if old == "refit" and value == "none" else value
    start, weights, guard = current["start"], current["weights"], current["guard"]
    # budget
    budget = base.budget
    if sparsity is not None and nm is not None:
        raise ValueError("give sparsity= or nm=, not both (CLI: --sparsity or --nm)")
    if sparsity is not None or nm is not None or scope is not None:
        budget = Budget(
            sparsity=sparsity if sparsity is not None else (None if nm is not None else budget.sparsity),
            nm=nm if nm is not None else (None if sparsity is not None else budget.nm),
            scope=scope if scope is not None else "row" if nm is not None else budget.scope,
        )
    # start
    start_stage = base.start
    if start is not None and start != start_stage.name:
        start_stage = _by_name(start, "start", START_STAGES)
    if start_damp is not None:
        if not start_stage.computes_weights:
            raise ValueError(
                f"start_damp is an option of start='sparsegpt', 'admm' or 'alps', but start is {start_stage.name!r}"
            )
        start_stage = dataclasses.replace(start_stage, damp=start_damp)
    # refine
    refine_stage = base.refine
    if refine is not None and refine != refine_stage.name:
        refine_stage = _by_name(refine, "refine", REFINE_STAGES)
    swap_options = {
        "max_iters": max_iters,
        "eps": eps,
        "objective": objective,
        "search_dtype": search_dtype,
        "backend": backend,
        "swap_scope": swap_scope,
    }
    swap_options = {k: v for k, v in swap_options.items() if v is not None}
    if swap_options:
        if not isinstance(refine_stage, SwapRefine):
            raise ValueError(
                f"{_options_of(swap_options)} refine='sparseswaps', but refine is {refine_stage.name!r}: drop "
                "them, or refine with sparseswaps (refine='sparseswaps' with a weight stage for the refined "
                "mask, CLI: --refine sparseswaps --weights keep|ls; or a recipe that swaps: --recipe sparseswaps or "
                "sparseswaps-refit)"
            )
        fields_ = {"scope" if k == "swap_scope" else k: v for k, v in swap_options.items()}
        refine_stage = dataclasses.replace(refine_stage, **fields_)
    # weights
    weights_stage = base.weights
    if weights is not None and weights != weights_stage.name:
        weights_stage = _by_name(weights, "weights", WEIGHT_STAGES)
    update = {k: v for k, v in {"damp": damp, "guard": guard}.items() if v is not None}
    if update:
        if weights_stage.keeps_start_weights and damp is not None:
            raise ValueError("damp is not an option of weights='start' (the start's own weights): use start_damp")
        if not weights_stage.updates_weights:
            raise ValueError(
                f"{_options_of(update)} a weight update (weights='ls', 'cg' or 'obs'), but weights='keep': drop "
                "them or choose a weight update"
            )
        weights_stage = dataclasses.replace(weights_stage, **update)
    if ridge is not None:
        if not isinstance(weights_stage, LeastSquares):
            raise ValueError(
                f"ridge is an option of weights='ls' or 'cg' (least squares), but weights={weights_stage.name!r}: "
                "drop it or use weights='ls'"
            )
        if ridge != weights_stage.ridge:
            weights_stage = dataclasses.replace(weights_stage, ridge=ridge, damp=damp)
    return PruneSpec(budget=budget, start=start_stage, refine=refine_stage, weights=weights_stage)
