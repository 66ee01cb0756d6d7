"""The typed stages of one layer's pruning; each stage holds its own defaults.

A layer is pruned in three stages, each a small frozen dataclass; :class:`PruneSpec` holds one of each plus the
budget, and rejects combinations that mean nothing when it is built:

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

``PruneSpec()`` is :data:`SPARSESWAPS_SPEC`, SparseSwaps masks only (Wanda start, 25 swap iterations, weights kept):
what the namesake entry points run with no spec. The named methods (the CLI's ``best`` default: ALPS's solution,
then block tuning; the published baselines) are recipes (:mod:`sparseswaps_prune.recipes`). :func:`build_spec` maps
the flat option names that the CLI, the prune method and the callback share onto the stages.

Example:
    >>> spec = build_spec(nm=(2, 4))                        # SparseSwaps masks only, 2:4
    >>> spec = build_spec(max_iters=50, weights="ls")       # Wanda -> SparseSwaps T=50 -> least-squares re-fit
    >>> spec = PruneSpec(budget=Budget(sparsity=0.5), start=SparseGPTStart(), refine=NoRefine(),
    ...                  weights=OBSUpdate())                  # SparseGPT as published (with scope="layer")
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sparseswaps_prune.core import admm, alps
from sparseswaps_prune.core.checks import check_budget, check_int, check_number
from sparseswaps_prune.core.refit import RIDGE_DAMPS, RIDGES
from sparseswaps_prune.core.sparsegpt import SPARSEGPT_DAMP

SCORES = ("magnitude", "wanda", "ria")
STARTS = (*SCORES, "sparsegpt", "admm", "alps")
REFINES = ("sparseswaps", "dsnot", "none")
WEIGHTS = ("keep", "ls", "cg", "obs", "admm", "alps", "start")
SCOPES = ("row", "layer")
OBJECTIVES = ("mask", "refit")
SEARCH_BACKENDS = ("auto", "torch", "numba", "triton")


def _options_of(options: dict[str, Any]) -> str:
    """``"max_iters is an option of"`` / ``"max_iters, eps are options of"``."""
    return f"{', '.join(options)} {'is an option' if len(options) == 1 else 'are options'} of"


def _choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class Budget:
    """How many weights a layer keeps: exactly one of ``sparsity`` and ``nm``.

    Attributes:
        sparsity: fraction of weights pruned, in ``[0, 1)``: per row (``scope="row"``, every row keeps
            ``d_in - round(sparsity * d_in)``) or per layer (``scope="layer"``).
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row, e.g. ``(2, 4)``.
        scope: ``"row"`` or ``"layer"`` (the start selects per layer and SparseSwaps also moves weights between
            rows, keeping the layer's count); N:M fixes every block's count, so it needs ``"row"``.
    """

    sparsity: float | None = None
    nm: tuple[int, int] | None = None
    scope: str = "row"

    def __post_init__(self) -> None:
        if isinstance(self.nm, list):
            object.__setattr__(self, "nm", tuple(self.nm))
        check_budget(self.sparsity, self.nm, None)
        _choice(self.scope, "scope", SCOPES)
        if self.scope == "layer" and self.nm is not None:
            raise ValueError(
                f"scope='layer' has no meaning with nm={self.nm} (N:M fixes the count of every block of every row); "
                "use scope='row' with nm, or sparsity= with scope='layer'"
            )


@dataclass(frozen=True)
class ScoreStart:
    """Start mask from importance scores (``core.warmstart.importance_scores``), selected under the budget.

    Attributes:
        score: ``"magnitude"`` (``|W|``), ``"wanda"`` (``|W| * ||X_j||``) or ``"ria"``.
    """

    kind: ClassVar[str] = "score"
    score: str = "wanda"

    def __post_init__(self) -> None:
        _choice(self.score, "start score", SCORES)

    @property
    def name(self) -> str:
        return self.score


@dataclass(frozen=True)
class SparseGPTStart:
    """SparseGPT's mask (its per-block OBS selection), with the original weights kept.

    Attributes:
        damp: SparseGPT's relative dampening of its Hessian (``percdamp``).
        blocksize: columns per block (a multiple of ``m`` for N:M).
    """

    kind: ClassVar[str] = "sparsegpt"
    damp: float = SPARSEGPT_DAMP
    blocksize: int = 128

    def __post_init__(self) -> None:
        check_number(self.damp, "start damp (SparseGPT's percdamp)", low=0)
        check_int(self.blocksize, "start blocksize", low=1)

    @property
    def name(self) -> str:
        return "sparsegpt"


@dataclass(frozen=True)
class ADMMStart:
    """ADMM pruning (Boza 2024, ``core.admm.admm_prune``): the mask is re-selected from ``|W + U|`` while the
    weights compensate; the original's defaults. Use ``scope="layer"`` for the original's layer-wise top-k.

    Attributes:
        iters: ADMM iterations; reselect_iters: the first this many re-select the mask.
        rho: ADMM penalty; damp: ridge as a fraction of the normalised Gram's mean diagonal.
    """

    kind: ClassVar[str] = "admm"
    iters: int = admm.ADMM_ITERS
    reselect_iters: int = admm.ADMM_RESELECT_ITERS
    rho: float = admm.ADMM_RHO
    damp: float = admm.ADMM_DAMP

    def __post_init__(self) -> None:
        check_int(self.iters, "start iters", low=0)
        check_int(self.reselect_iters, "start reselect_iters", low=0)
        if self.reselect_iters > self.iters:
            raise ValueError(f"start reselect_iters={self.reselect_iters} exceeds iters={self.iters}")
        check_number(self.rho, "start rho", low=0)
        check_number(self.damp, "start damp", low=0)

    @property
    def name(self) -> str:
        return "admm"


@dataclass(frozen=True)
class ALPSStart:
    """ALPS (Meng et al. 2024, ``core.alps.alps_prune``): ADMM with a support-driven ``rho`` schedule, then
    conjugate gradients on the final support; the original's defaults (layer-wise: ``scope="layer"``).

    Attributes:
        rho: initial ADMM penalty; max_iter, update_iter, switch_iter: the schedule's iteration limits.
        cg_iters, cg_rtol: the final conjugate-gradient steps; damp: ridge as a fraction of the mean diagonal.
    """

    kind: ClassVar[str] = "alps"
    rho: float = alps.ALPS_RHO
    max_iter: int = alps.ALPS_MAX_ITER
    update_iter: int = alps.ALPS_UPDATE_ITER
    switch_iter: int = alps.ALPS_SWITCH_ITER
    cg_iters: int = alps.ALPS_CG_ITERS
    cg_rtol: float = alps.ALPS_CG_RTOL
    damp: float = alps.ALPS_DAMP

    def __post_init__(self) -> None:
        for name in ("max_iter", "update_iter", "switch_iter", "cg_iters"):
            check_int(getattr(self, name), f"start {name}", low=0 if name != "update_iter" else 1)
        for name in ("rho", "cg_rtol", "damp"):
            check_number(getattr(self, name), f"start {name}", low=0)

    @property
    def name(self) -> str:
        return "alps"


@dataclass(frozen=True)
class SwapRefine:
    """SparseSwaps: exact, loss-decreasing 1-swaps (``core.refine.refine_mask``).

    Attributes:
        max_iters: iterations ``T_max`` per layer, each applying at most one move per row (0: the start mask).
            The default, 25, has about 89% of the converged loss reduction on the default model (the paper: "values
            around T=25 often suffice"; see :data:`SPARSESWAPS_SPEC`).
        eps: a move is applied only if it lowers the loss by more than ``eps`` (>= 0).
        objective: ``"mask"`` (the loss with the kept weights as they are, the paper's) or ``"refit"`` (the loss
            after re-fitting the kept weights; needs ``weights=LeastSquares(solver="direct")``, whose ridge it uses,
            and yields those re-fitted weights itself).
        search_dtype: ``"float32"`` or ``"float64"`` swap search of the mask objective (acceptance is float64).
        backend: swap search: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"``.
        resync_every: rebuild the float64 state from scratch every this many iterations.
        scope: where moves may go: None (the budget's scope), or ``"row"``: swaps within rows, every row keeping
            the start's count, also under a per-layer budget (e.g. after ADMM's or ALPS's layer-wise mask: the
            layer's total is kept and the cheaper per-row search runs).
    """

    kind: ClassVar[str] = "sparseswaps"
    max_iters: int = 25
    eps: float = 0.0
    objective: str = "mask"
    search_dtype: str = "float32"
    backend: str = "auto"
    resync_every: int = 32
    scope: str | None = None

    def __post_init__(self) -> None:
        check_int(self.max_iters, "max_iters", low=0)
        check_number(self.eps, "eps", low=0)
        _choice(self.objective, "objective", OBJECTIVES)
        _choice(self.search_dtype, "search_dtype", ("float32", "float64"))
        _choice(self.backend, "backend", SEARCH_BACKENDS)
        check_int(self.resync_every, "resync_every", low=1)
        if self.scope is not None:
            _choice(self.scope, "swap scope", ("row",))

    @property
    def name(self) -> str:
        return "sparseswaps"


@dataclass(frozen=True)
class DSnoTRefine:
    """DSnoT (Zhang et al. 2024, ``core.dsnot.dsnot_refine``), with the original's settings.

    Attributes:
        max_cycles: at most this many prune-and-grow cycles per row (50).
        update_threshold: a row stops once its expected error is this small (0.1).
        skip: layers whose name contains ``.<skip>.`` keep their start mask (the original's default ``"mlp"``:
            attention projections only); None refines every layer.
    """

    kind: ClassVar[str] = "dsnot"
    max_cycles: int = 50
    update_threshold: float = 0.1
    skip: str | None = "mlp"

    def __post_init__(self) -> None:
        check_int(self.max_cycles, "max_cycles", low=0)
        check_number(self.update_threshold, "update_threshold", low=0)

    @property
    def name(self) -> str:
        return "dsnot"


@dataclass(frozen=True)
class NoRefine:
    """The start mask is the final mask."""

    kind: ClassVar[str] = "none"

    @property
    def name(self) -> str:
        return "none"


@dataclass(frozen=True)
class KeepWeights:
    """The kept weights stay as they are (the paper's SparseSwaps)."""

    kind: ClassVar[str] = "keep"

    @property
    def name(self) -> str:
        return "keep"


@dataclass(frozen=True)
class LeastSquares:
    """Re-fit every row's kept weights by exact least squares on the calibration Gram (``core.refit``).

    Attributes:
        solver: ``"direct"`` (per-row Cholesky of ``G_SS``) or ``"cg"`` (batched conjugate gradients sharing
            ``G``, for wide layers).
        damp: relative ridge (also the re-fit objective's); None: the ridge's default (``RIDGE_DAMPS``: 1e-3 for
            ``"mean"``, 0.1 for ``"diag"``), stored resolved.
        guard: with held-out windows, a row keeps its re-fit only where it lowers that row's held-out loss against
            its fallback: the start's own weights (SparseGPT, ADMM, ALPS) where the row's mask is still the
            start's, else the original weights on the mask.
        ridge: ``"diag"`` (default): least squares on ``G + damp * diag(G)``, shrinking towards the dense weights
            (the problem ADMM's update solves on a fixed mask; ``core.refit.refit_weights``); ``"mean"``:
            ``lambda = damp * mean(diag G)``, shrinking towards zero (the default until 2026-11-25, with the guard).

    The defaults (ridge ``"diag"``, damp 0.1, no guard) gave the best held-out perplexity on the default model at
    60%, 70% and 2:4 (RESULTS.md, "ADMM's ridge in our re-fit"); with this ridge the guard no longer helps.
    """

    kind: ClassVar[str] = "least_squares"
    solver: str = "direct"
    damp: float | None = None
    guard: bool = False
    ridge: str = "diag"

    def __post_init__(self) -> None:
        _choice(self.solver, "least-squares solver", ("direct", "cg"))
        _choice(self.ridge, "least-squares ridge", RIDGES)
        if self.damp is None:
            object.__setattr__(self, "damp", RIDGE_DAMPS[self.ridge])
        check_number(self.damp, "damp", low=0)
        _check_guard(self.guard)

    @property
    def name(self) -> str:
        return "ls" if self.solver == "direct" else "cg"


@dataclass(frozen=True)
class OBSUpdate:
    """SparseGPT's OBS weight update on the final mask (``core.sparsegpt.sparsegpt_prune(keep_mask=...)``).

    Attributes:
        damp: SparseGPT's relative dampening (``percdamp``).
        guard: as :class:`LeastSquares` (off by default: SparseGPT as published).
    """

    kind: ClassVar[str] = "obs"
    damp: float = SPARSEGPT_DAMP
    guard: bool = False

    def __post_init__(self) -> None:
        check_number(self.damp, "damp", low=0)
        _check_guard(self.guard)

    @property
    def name(self) -> str:
        return "obs"


@dataclass(frozen=True)
class ADMMUpdate:
    """ADMM's weight update on the final mask (``core.admm.admm_update``: the mask held fixed).

    Attributes:
        iters, rho, damp: as :class:`ADMMStart`; guard: as :class:`LeastSquares` (off: ADMM as published).
    """

    kind: ClassVar[str] = "admm_update"
    iters: int = admm.ADMM_ITERS
    rho: float = admm.ADMM_RHO
    damp: float = admm.ADMM_DAMP
    guard: bool = False

    def __post_init__(self) -> None:
        check_int(self.iters, "iters", low=0)
        check_number(self.rho, "rho", low=0)
        check_number(self.damp, "damp", low=0)
        _check_guard(self.guard)

    @property
    def name(self) -> str:
        return "admm"


@dataclass(frozen=True)
class ALPSUpdate:
    """ALPS's weight update on the final mask (``core.alps.alps_update``: ADMM on a fixed support, then
    conjugate gradients).

    Attributes:
        admm_iters, rho, cg_iters, cg_rtol, damp: as ``alps_update``; guard: as :class:`LeastSquares`.
    """

    kind: ClassVar[str] = "alps_update"
    admm_iters: int = alps.ALPS_UPDATE_ADMM_ITERS
    rho: float = alps.ALPS_RHO
    cg_iters: int = alps.ALPS_CG_ITERS
    cg_rtol: float = alps.ALPS_CG_RTOL
    damp: float = alps.ALPS_DAMP
    guard: bool = False

    def __post_init__(self) -> None:
        check_int(self.admm_iters, "admm_iters", low=0)
        check_int(self.cg_iters, "cg_iters", low=0)
        for name in ("rho", "cg_rtol", "damp"):
            check_number(getattr(self, name), name, low=0)
        _check_guard(self.guard)

    @property
    def name(self) -> str:
        return "alps"


@dataclass(frozen=True)
class StartWeights:
    """The weights the start computed for its own mask (SparseGPT's OBS, ADMM's, ALPS's): the published method.
    Only with a start that computes weights and no refinement (they fit the start mask only).

    Attributes:
        guard: as :class:`LeastSquares` (off: as published).
    """

    kind: ClassVar[str] = "start"
    guard: bool = False

    def __post_init__(self) -> None:
        _check_guard(self.guard)

    @property
    def name(self) -> str:
        return "start"


def _check_guard(guard: object) -> None:
    if not isinstance(guard, bool):
        raise TypeError(f"guard must be a bool, got {guard!r}")


Start = ScoreStart | SparseGPTStart | ADMMStart | ALPSStart
Refine = SwapRefine | DSnoTRefine | NoRefine
Weights = KeepWeights | LeastSquares | OBSUpdate | ADMMUpdate | ALPSUpdate | StartWeights
WEIGHT_STARTS = (SparseGPTStart, ADMMStart, ALPSStart)
_STAGES: dict[str, tuple[type, ...]] = {
    "start": (ScoreStart, SparseGPTStart, ADMMStart, ALPSStart),
    "refine": (SwapRefine, DSnoTRefine, NoRefine),
    "weights": (KeepWeights, LeastSquares, OBSUpdate, ADMMUpdate, ALPSUpdate, StartWeights),
}


@dataclass(frozen=True)
class PruneSpec:
    """How one layer is pruned: budget, start, refine, weights (see the module docstring). With no arguments, every
    stage's own defaults: SparseSwaps masks only, 60% per row, Wanda start, 25 exact 1-swap iterations (mask
    objective), the kept weights as they are (:data:`SPARSESWAPS_SPEC`).

    Raises ``TypeError``/``ValueError`` naming the stage and the fix when built with a stage of the wrong type or
    a combination that means nothing (e.g. ``SwapRefine(objective="refit")`` without ``LeastSquares`` weights).
    """

    budget: Budget = field(default_factory=lambda: Budget(sparsity=0.6))
    start: Start = field(default_factory=ScoreStart)
    refine: Refine = field(default_factory=SwapRefine)
    weights: Weights = field(default_factory=KeepWeights)

    def __post_init__(self) -> None:
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be a Budget, got {type(self.budget).__name__}")
        for stage, types in _STAGES.items():
            value = getattr(self, stage)
            if not isinstance(value, types):
                raise TypeError(
                    f"{stage} must be one of {', '.join(t.__name__ for t in types)}; got {type(value).__name__}"
                )
        refine, weights = self.refine, self.weights
        if isinstance(refine, SwapRefine) and refine.objective == "refit":
            if not (isinstance(weights, LeastSquares) and weights.solver == "direct"):
                raise ValueError(
                    "refine=SwapRefine(objective='refit') chooses masks for their exact least-squares re-fit and "
                    f"yields those weights itself, so weights must be LeastSquares(solver='direct'), got {weights} "
                    "(CLI: --weights ls)"
                )
        if isinstance(weights, StartWeights):
            if not isinstance(self.start, WEIGHT_STARTS):
                raise ValueError(
                    f"weights=StartWeights keeps the weights the start computed, but start {self.start.name!r} "
                    "computes none; use start='sparsegpt', 'admm' or 'alps', or another weight stage (e.g. "
                    "weights='ls'; CLI --recipe sparseswaps-refit: Wanda -> SparseSwaps -> re-fit)"
                )
            if not isinstance(refine, NoRefine):
                raise ValueError(
                    "weights=StartWeights keeps the start's weights, which fit the start mask only, but the mask is "
                    f"refined ({refine.name}); use refine='none', or weights='ls', 'admm' or 'alps' for the refined "
                    "mask"
                )
        if isinstance(self.start, SparseGPTStart) and self.budget.nm is not None:
            m = self.budget.nm[1]
            if self.start.blocksize % m:
                raise ValueError(f"SparseGPTStart.blocksize={self.start.blocksize} must be a multiple of m={m} for N:M")

    @property
    def updates_weights(self) -> bool:
        """True if the final kept weights differ from the original ones (a re-fit or OBS update)."""
        return not isinstance(self.weights, KeepWeights)

    @property
    def row_obstacle(self) -> str | None:
        """Why the rows of a layer cannot be pruned apart (None: they can, :attr:`row_separable`)."""
        if self.budget.scope != "row":
            return "a per-layer budget (scope='layer') selects weights across rows"
        if isinstance(self.start, ScoreStart) and self.start.score == "ria":
            return "RIA's scores divide by column sums over all rows"
        why = {
            "sparsegpt": "its float32 OBS updates of a few rows round differently from those of many",
            "obs": "its float32 OBS updates of a few rows round differently from those of many",
            "admm": "it is not verified row by row (float32 products on the transposed layer)",
            "alps": "its penalty schedule counts the mask changes of the whole layer",
        }
        if not isinstance(self.start, ScoreStart):
            return f"the {self.start.name} start does not treat rows apart: {why[self.start.name]}"
        if not isinstance(self.weights, (KeepWeights, LeastSquares)):
            return f"the {self.weights.name} weight update does not treat rows apart: {why[self.weights.name]}"
        return None

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
        for stage in _STAGES:
            value = getattr(self, stage)
            out[stage] = {"kind": value.kind, **dataclasses.asdict(value)}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruneSpec:
        """The spec ``to_dict`` wrote (unknown kinds or fields raise ``ValueError``)."""
        stages = {}
        for stage, types in _STAGES.items():
            fields_ = dict(data[stage])
            kind = fields_.pop("kind")
            by_kind = {t.kind: t for t in types}
            if kind not in by_kind:
                raise ValueError(f"unknown {stage} kind {kind!r}; expected one of {', '.join(by_kind)}")
            try:
                stages[stage] = by_kind[kind](**fields_)
            except TypeError as err:
                raise ValueError(f"{stage}: {err}") from None
        budget = dict(data["budget"])
        if budget.get("nm") is not None:
            budget["nm"] = tuple(budget["nm"])
        return cls(budget=Budget(**budget), **stages)

    def describe(self) -> str:
        """One line naming every stage, e.g. ``60% per row: wanda -> sparseswaps T=10 (mask) -> ls (diag ridge
        0.1)``."""
        budget = self.budget
        head = f"{budget.nm[0]}:{budget.nm[1]}" if budget.nm else f"{budget.sparsity:.0%} per {budget.scope}"
        refine = self.refine.name
        if isinstance(self.refine, SwapRefine):
            refine += f" T={self.refine.max_iters} ({self.refine.objective})"
            refine += " (within rows)" if self.refine.scope == "row" and budget.scope == "layer" else ""
        weights = self.weights.name
        if isinstance(self.weights, LeastSquares):
            weights += f" ({self.weights.ridge} ridge {self.weights.damp:g})"
        weights += " (guarded)" if getattr(self.weights, "guard", False) else ""
        return f"{head}: {self.start.name} -> {refine} -> {weights}"


SPARSESWAPS_SPEC = PruneSpec()
"""SparseSwaps as the paper states it, masks only: 60% per row, Wanda's mask, then 25 iterations of exact,
loss-decreasing 1-swaps within rows under the mask objective; the kept weights stay as they are. What the namesake
entry points run with no spec (``prune_layer``, :class:`~sparseswaps_prune.prune.SparseSwapsMethod`,
``sparseswaps_unstructured``, the Lightning callback) and ``PruneSpec()``: every stage's own defaults.

Why this start and T: from every score start the swaps end close together, Wanda's is the cheapest start that treats
rows apart (RIA's scores need column sums), and T=25 has about 89% of the converged loss reduction on the default
model at a quarter of T=100's time (perplexity 54.22 at T=25 against 61.66 at T=10 and 50.58 at T=100, 60% per row;
RESULTS.md "SparseSwaps vs Wanda"), as the paper finds ("values around T=25 often suffice")."""


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
    for old, value in renamed.items():
        if old not in RENAMED_OPTIONS:
            raise TypeError(f"unknown option {old}={value!r}; the options are {', '.join(SPEC_OPTIONS)}")
        new = RENAMED_OPTIONS[old]
        warnings.warn(f"{old}= is renamed {new}= (it will be removed in the next release)", DeprecationWarning, 3)
        if old == "refit" and value == "none":
            value = "keep"
        if locals()[new] is not None:
            raise ValueError(f"give {new}= only (not also its former name {old}=)")
        if new == "start":
            start = value
        elif new == "weights":
            weights = value
        else:
            guard = value
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
        _choice(start, "start", STARTS)
        start_stage = {"sparsegpt": SparseGPTStart, "admm": ADMMStart, "alps": ALPSStart}.get(
            start, lambda: ScoreStart(start)
        )()
    if start_damp is not None:
        if not isinstance(start_stage, WEIGHT_STARTS):
            raise ValueError(
                f"start_damp is an option of start='sparsegpt', 'admm' or 'alps', but start is {start_stage.name!r}"
            )
        start_stage = dataclasses.replace(start_stage, damp=start_damp)
    # refine
    refine_stage = base.refine
    if refine is not None and refine != refine_stage.name:
        _choice(refine, "refine", REFINES)
        refine_stage = {"sparseswaps": SwapRefine, "dsnot": DSnoTRefine, "none": NoRefine}[refine]()
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
        _choice(weights, "weights", WEIGHTS)
        weights_stage = {
            "keep": KeepWeights,
            "ls": LeastSquares,
            "cg": lambda: LeastSquares(solver="cg"),
            "obs": OBSUpdate,
            "admm": ADMMUpdate,
            "alps": ALPSUpdate,
            "start": StartWeights,
        }[weights]()
    update = {k: v for k, v in {"damp": damp, "guard": guard}.items() if v is not None}
    if update:
        if isinstance(weights_stage, StartWeights) and damp is not None:
            raise ValueError("damp is not an option of weights='start' (the start's own weights): use start_damp")
        if isinstance(weights_stage, KeepWeights):
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
