"""The stages of one layer's pruning: each a small frozen dataclass that holds its own defaults and does its own
work behind its role's one method.

A layer is pruned under a :class:`Budget` in three stages (:func:`~sparseswaps_prune.core.layer.prune_layer`
composes them; :class:`~sparseswaps_prune.core.spec.PruneSpec` holds one of each):

* **start** (:class:`StartStage`): ``select(weight, gram, budget, ctx) -> (keep_mask, weights or None)``, the first
  mask and, for a start that computes them and a weight stage that asks (:attr:`WeightStage.wants_start_weights`),
  its weights for that mask: :class:`ScoreStart` (magnitude | wanda | ria scores, then selection),
  :class:`SparseGPTStart`, :class:`ADMMStart` (Boza 2024) or :class:`ALPSStart` (Meng et al. 2024);
* **refine** (:class:`RefineStage`): ``refine(weight, gram, start_mask, budget, ctx) -> Refinement``:
  :class:`SwapRefine` (SparseSwaps, under the mask or the re-fit objective), :class:`DSnoTRefine` or
  :class:`NoRefine`;
* **weights** (:class:`WeightStage`): ``fit(weight, gram, keep_mask, ctx, start_weight=, refined_weight=) ->
  weights or None``: :class:`KeepWeights`, :class:`LeastSquares` (exact per-row re-fit, direct or
  conjugate-gradient solver), :class:`OBSUpdate` (SparseGPT's update on the final mask), :class:`ADMMUpdate` or
  :class:`ALPSUpdate` (their updates on the final mask) or :class:`StartWeights`; a weight update may be guarded
  by held-out calibration windows (a row keeps its update only where it lowers that row's held-out loss).

Every stage also says what it needs of the rest of the spec (:meth:`Stage.check`, when the spec is built) and of
the layer's inputs (:meth:`Stage.check_inputs`, before any work), and why it does not treat rows apart
(:attr:`Stage.row_obstacle`). The flat option names (``build_spec``, the CLI) come from each stage's
:attr:`Stage.names`; a new stage is one class here, plus its line in its role's table (:data:`START_STAGES`,
:data:`REFINE_STAGES`, :data:`WEIGHT_STAGES`) to be reachable by name and from JSON.

The stages validate their own fields when built and trust the tensors ``prune_layer`` validated once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from sparseswaps_prune.core import admm, alps
from sparseswaps_prune.core.admm import admm_prune, admm_update
from sparseswaps_prune.core.alps import alps_prune, alps_update
from sparseswaps_prune.core.checks import check_bool, check_budget, check_choice, check_int, check_number
from sparseswaps_prune.core.dsnot import dsnot_refine
from sparseswaps_prune.core.losses import weight_losses_unchecked
from sparseswaps_prune.core.refine import RESYNC_EVERY, SWAP_ITERS, refine_mask
from sparseswaps_prune.core.refit import REFIT_RIDGE, RIDGE_DAMPS, RIDGES, refit_weights
from sparseswaps_prune.core.select import select_mask_unchecked, select_within
from sparseswaps_prune.core.sparsegpt import SPARSEGPT_DAMP, sparsegpt_prune
from sparseswaps_prune.core.warmstart import SCORES, importance_scores_unchecked

if TYPE_CHECKING:
    from sparseswaps_prune.core.spec import PruneSpec

SCOPES = ("row", "layer")
OBJECTIVES = ("mask", "refit")
SEARCH_BACKENDS = ("auto", "torch", "numba", "triton")

FeatureStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(mean, var, sq_mean)`` ``[d_in]`` input statistics (``GramAccumulator.feature_stats``)."""


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
        check_choice(self.scope, "scope", SCOPES)
        if self.scope == "layer" and self.nm is not None:
            raise ValueError(
                f"scope='layer' has no meaning with nm={self.nm} (N:M fixes the count of every block of every row); "
                "use scope='row' with nm, or sparsity= with scope='layer'"
            )

    @property
    def pattern(self) -> dict[str, object]:
        """``sparsity=``, ``nm=``, ``scope=`` as the selection functions take them."""
        return {"sparsity": self.sparsity, "nm": self.nm, "scope": self.scope}


@dataclass(frozen=True)
class StageContext:
    """What a stage may need of one ``prune_layer`` call besides the weight, the Gram and the budget.

    Attributes:
        weights: the spec's weight stage (whether the start should also return its weights; the re-fit
            objective's ridge).
        prior_mask: ``[d_out, d_in]`` bool mask of an already pruned tensor that keeps some weights pruned (None:
            dense); the weight is already zero off it.
        feature_stats: ``(mean, var, sq_mean)`` input statistics (DSnoT's).
        name: the layer's name (``DSnoTRefine.skip``).
        device: where refinement and weight updates run (None: the weight's device).
    """

    weights: WeightStage
    prior_mask: torch.Tensor | None = None
    feature_stats: FeatureStats | None = None
    name: str | None = None
    device: torch.device | str | None = None


@dataclass
class Refinement:
    """What a refiner returns.

    Attributes:
        mask: ``[d_out, d_in]`` bool refined mask.
        n_swaps: ``[d_out]`` int64 moves (SparseSwaps) or updates (DSnoT) per row.
        iters: iterations (cycles for DSnoT) that changed the mask.
        weight: weights the refinement computed for ``mask`` (the re-fit objective's exact re-fit), else None.
        loss_start, loss_refined: ``[d_out]`` float64 per-row losses of the start and refined masks with the
            original weights.
    """

    mask: torch.Tensor
    n_swaps: torch.Tensor
    iters: int
    weight: torch.Tensor | None
    loss_start: torch.Tensor
    loss_refined: torch.Tensor


def mask_losses(weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """``[d_out]`` float64 per-row loss of ``keep_mask`` with the original weights (``core.losses.row_losses`` on
    inputs already validated)."""
    return weight_losses_unchecked(weight, torch.where(keep_mask, weight, 0), gram)


class Stage(ABC):
    """What every stage has: its option names and its checks. Subclasses are frozen dataclasses.

    Class attributes:
        kind: the tag ``PruneSpec.to_dict`` writes (unique within the role).
        names: the flat option values that build this stage (``build_spec``, the CLI); the first is its name.
        role: the role in messages (``"start"``, ``"refine"``, ``"weight update"``; set by the role's base class).
        rows_apart: why the stage does not treat each output row on its own (None: it does).
    """

    kind: ClassVar[str]
    names: ClassVar[tuple[str, ...]]
    role: ClassVar[str]
    rows_apart: ClassVar[str | None] = None

    @property
    def name(self) -> str:
        """The option value this stage answers to (e.g. ``"wanda"``, ``"ls"``)."""
        return self.names[0]

    @classmethod
    def from_name(cls, name: str) -> Stage:
        """The stage with its defaults that option value ``name`` (one of :attr:`names`) builds."""
        return cls()

    def check(self, spec: PruneSpec) -> None:  # noqa: B027 - most stages go with any other
        """Raise ``ValueError`` naming the fix when this stage means nothing in ``spec`` (called when it is built)."""

    def check_inputs(self, weight: torch.Tensor, budget: Budget, ctx: StageContext) -> None:  # noqa: B027
        """Raise ``ValueError`` naming the fix when this stage cannot run on the layer's inputs (before any work)."""

    @property
    def row_obstacle(self) -> str | None:
        """Why this stage does not treat rows apart (None: it does; ``PruneSpec.row_separable``)."""
        if self.rows_apart is None:
            return None
        return f"the {self.name} {self.role} does not treat rows apart: {self.rows_apart}"

    def describe(self, budget: Budget) -> str:
        """This stage in ``PruneSpec.describe``'s line."""
        return self.name


_OBS_ROWS = "its float32 OBS updates of a few rows round differently from those of many"


class StartStage(Stage):
    """A start: the first mask under the budget, and the weights it computed for that mask when asked.

    Class attributes:
        computes_weights: the start computes weights for its mask (``StartWeights`` keeps them; a guarded update
            falls back to them).
        prunes_again: the start selects within ``ctx.prior_mask`` (iterative pruning of an already pruned tensor:
            each row prunes ``sparsity`` of what the prior keeps; not N:M); else such a tensor is refused.
    """

    role: ClassVar[str] = "start"
    computes_weights: ClassVar[bool] = False
    prunes_again: ClassVar[bool] = False

    @abstractmethod
    def select(
        self, weight: torch.Tensor, gram: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[d_out, d_in]`` bool mask under ``budget`` (True = kept), within ``ctx.prior_mask`` when given, and
        the start's weights for it (``weight``'s dtype, zero off the mask) when ``ctx.weights.wants_start_weights``
        and the start computes them, else None. ``weight`` and ``gram`` are validated and not modified."""

    def check_inputs(self, weight: torch.Tensor, budget: Budget, ctx: StageContext) -> None:
        if ctx.prior_mask is not None and not self.prunes_again:
            raise _already_pruned(self.name)
        if ctx.prior_mask is not None and budget.nm is not None:
            raise _already_pruned("N:M")


def _already_pruned(what: str) -> ValueError:
    return ValueError(
        f"{what} pruning of an already pruned tensor is not supported; make the earlier pruning permanent "
        "(prune.remove), start from the dense weights, or prune it again with an ADMM or score start, not N:M (e.g. "
        "the default spec, SPARSESWAPS_SPEC)"
    )


@dataclass(frozen=True)
class ScoreStart(StartStage):
    """Start mask from importance scores (``core.warmstart.importance_scores``), selected under the budget.

    Attributes:
        score: ``"magnitude"`` (``|W|``), ``"wanda"`` (``|W| * ||X_j||``) or ``"ria"`` (the default: relative
            importance, ``|W|`` over its row's and its column's sums, times ``||X_j|| ** 0.5``; the best score start
            for the swaps measured, RESULTS.md "Masks only, 64 windows, on two texts").
    """

    kind: ClassVar[str] = "score"
    names: ClassVar[tuple[str, ...]] = SCORES
    prunes_again: ClassVar[bool] = True
    score: str = "ria"

    def __post_init__(self) -> None:
        check_choice(self.score, "start score", SCORES)

    @property
    def name(self) -> str:
        return self.score

    @classmethod
    def from_name(cls, name: str) -> ScoreStart:
        return cls(name)

    @property
    def row_obstacle(self) -> str | None:
        return "RIA's scores divide by column sums over all rows" if self.score == "ria" else None

    def select(
        self, weight: torch.Tensor, gram: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> tuple[torch.Tensor, None]:
        scores = importance_scores_unchecked(weight, self.score, gram)
        if ctx.prior_mask is None:
            return select_mask_unchecked(scores, **budget.pattern), None
        return select_within(scores, ctx.prior_mask, budget.sparsity), None


@dataclass(frozen=True)
class SparseGPTStart(StartStage):
    """SparseGPT's mask (its per-block OBS selection), with the original weights kept.

    Attributes:
        damp: SparseGPT's relative dampening of its Hessian (``percdamp``).
        blocksize: columns per block (a multiple of ``m`` for N:M).
    """

    kind: ClassVar[str] = "sparsegpt"
    names: ClassVar[tuple[str, ...]] = ("sparsegpt",)
    computes_weights: ClassVar[bool] = True
    rows_apart: ClassVar[str | None] = _OBS_ROWS
    damp: float = SPARSEGPT_DAMP
    blocksize: int = 128

    def __post_init__(self) -> None:
        check_number(self.damp, "start damp (SparseGPT's percdamp)", low=0)
        check_int(self.blocksize, "start blocksize", low=1)

    def check(self, spec: PruneSpec) -> None:
        if spec.budget.nm is not None and self.blocksize % spec.budget.nm[1]:
            m = spec.budget.nm[1]
            raise ValueError(f"SparseGPTStart.blocksize={self.blocksize} must be a multiple of m={m} for N:M")

    def select(
        self, weight: torch.Tensor, gram: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        want = ctx.weights.wants_start_weights
        out = sparsegpt_prune(
            weight, gram, **budget.pattern, damp=self.damp, blocksize=self.blocksize, update_weights=want
        )
        return out.keep_mask, out.weight if want else None


@dataclass(frozen=True)
class ADMMStart(StartStage):
    """ADMM pruning (Boza 2024, ``core.admm.admm_prune``): the mask is re-selected from ``|W + U|`` while the
    weights compensate; the original's defaults. Use ``scope="layer"`` for the original's layer-wise top-k. An
    already pruned tensor is pruned again within its mask, each row pruning ``sparsity`` of what it keeps (as the
    score starts do; not N:M). The start of :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`.

    Attributes:
        iters: ADMM iterations; reselect_iters: the first this many re-select the mask.
        rho: ADMM penalty; damp: ridge as a fraction of the normalised Gram's mean diagonal.
    """

    kind: ClassVar[str] = "admm"
    names: ClassVar[tuple[str, ...]] = ("admm",)
    computes_weights: ClassVar[bool] = True
    prunes_again: ClassVar[bool] = True
    rows_apart: ClassVar[str | None] = "it is not verified row by row (float32 products on the transposed layer)"
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

    def select(
        self, weight: torch.Tensor, gram: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = admm_prune(
            weight, gram, **budget.pattern, iters=self.iters, reselect_iters=self.reselect_iters, rho=self.rho,
            damp=self.damp, prior_mask=ctx.prior_mask,
        )  # fmt: skip
        return out.keep_mask, out.weight if ctx.weights.wants_start_weights else None


@dataclass(frozen=True)
class ALPSStart(StartStage):
    """ALPS (Meng et al. 2024, ``core.alps.alps_prune``): ADMM with a support-driven ``rho`` schedule, then
    conjugate gradients on the final support; the original's defaults (layer-wise: ``scope="layer"``).

    Attributes:
        rho: initial ADMM penalty; max_iter, update_iter, switch_iter: the schedule's iteration limits.
        cg_iters, cg_rtol: the final conjugate-gradient steps; damp: ridge as a fraction of the mean diagonal.
    """

    kind: ClassVar[str] = "alps"
    names: ClassVar[tuple[str, ...]] = ("alps",)
    computes_weights: ClassVar[bool] = True
    rows_apart: ClassVar[str | None] = "its penalty schedule counts the mask changes of the whole layer"
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

    def select(
        self, weight: torch.Tensor, gram: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = alps_prune(
            weight, gram, **budget.pattern, rho=self.rho, max_iter=self.max_iter, update_iter=self.update_iter,
            switch_iter=self.switch_iter, cg_iters=self.cg_iters, cg_rtol=self.cg_rtol, damp=self.damp,
        )  # fmt: skip
        return out.keep_mask, out.weight if ctx.weights.wants_start_weights else None


class RefineStage(Stage):
    """A refiner: the final mask from the start's."""

    role: ClassVar[str] = "refine"

    @abstractmethod
    def refine(
        self, weight: torch.Tensor, gram: torch.Tensor, start_mask: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> Refinement:
        """The refined mask of ``start_mask`` under ``budget`` and both masks' losses. ``weight``, ``gram`` and
        ``start_mask`` are validated and not modified."""


def unrefined(weight: torch.Tensor, gram: torch.Tensor, start_mask: torch.Tensor) -> Refinement:
    """The :class:`Refinement` that keeps ``start_mask`` as it is."""
    loss = mask_losses(weight, gram, start_mask)
    return Refinement(start_mask, torch.zeros(weight.shape[0], dtype=torch.long), 0, None, loss, loss)


@dataclass(frozen=True)
class SwapRefine(RefineStage):
    """SparseSwaps: exact, loss-decreasing 1-swaps (``core.refine.refine_mask``).

    Attributes:
        max_iters: iterations ``T_max`` per layer, each applying at most one move per row (0: the start mask).
            The default, 25, has about 89% of the converged loss reduction on the default model (the paper: "values
            around T=25 often suffice"; see :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`).
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
    names: ClassVar[tuple[str, ...]] = ("sparseswaps",)
    max_iters: int = SWAP_ITERS
    eps: float = 0.0
    objective: str = "mask"
    search_dtype: str = "float32"
    backend: str = "auto"
    resync_every: int = RESYNC_EVERY
    scope: str | None = None

    def __post_init__(self) -> None:
        check_int(self.max_iters, "max_iters", low=0)
        check_number(self.eps, "eps", low=0)
        check_choice(self.objective, "objective", OBJECTIVES)
        check_choice(self.search_dtype, "search_dtype", ("float32", "float64"))
        check_choice(self.backend, "backend", SEARCH_BACKENDS)
        check_int(self.resync_every, "resync_every", low=1)
        if self.scope is not None:
            check_choice(self.scope, "swap scope", ("row",))

    def check(self, spec: PruneSpec) -> None:
        weights = spec.weights
        if self.objective == "refit" and not (isinstance(weights, LeastSquares) and weights.solver == "direct"):
            raise ValueError(
                "refine=SwapRefine(objective='refit') chooses masks for their exact least-squares re-fit and "
                f"yields those weights itself, so weights must be LeastSquares(solver='direct'), got {weights} "
                "(CLI: --weights ls)"
            )

    def describe(self, budget: Budget) -> str:
        within = " (within rows)" if self.scope == "row" and budget.scope == "layer" else ""
        return f"{self.name} T={self.max_iters} ({self.objective}){within}"

    def refine(
        self, weight: torch.Tensor, gram: torch.Tensor, start_mask: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> Refinement:
        fit = {"damp": ctx.weights.damp, "ridge": ctx.weights.ridge} if self.objective == "refit" else {}
        out = refine_mask(
            weight, gram, start_mask, max_iters=self.max_iters, nm=budget.nm, eps=self.eps, device=ctx.device,
            dtype=getattr(torch, self.search_dtype), backend=self.backend, resync_every=self.resync_every,
            objective=self.objective, scope=self.scope or budget.scope, **fit,
        )  # fmt: skip
        return Refinement(out.mask, out.n_swaps, out.iters, out.weight, out.loss_before, out.loss_after)


@dataclass(frozen=True)
class DSnoTRefine(RefineStage):
    """DSnoT (Zhang et al. 2024, ``core.dsnot.dsnot_refine``), with the original's settings.

    Attributes:
        max_cycles: at most this many prune-and-grow cycles per row (50).
        update_threshold: a row stops once its expected error is this small (0.1).
        skip: layers whose name contains ``.<skip>.`` keep their start mask (the original's default ``"mlp"``:
            attention projections only); None refines every layer.
    """

    kind: ClassVar[str] = "dsnot"
    names: ClassVar[tuple[str, ...]] = ("dsnot",)
    max_cycles: int = 50
    update_threshold: float = 0.1
    skip: str | None = "mlp"

    def __post_init__(self) -> None:
        check_int(self.max_cycles, "max_cycles", low=0)
        check_number(self.update_threshold, "update_threshold", low=0)

    def check_inputs(self, weight: torch.Tensor, budget: Budget, ctx: StageContext) -> None:
        if ctx.feature_stats is None:
            raise ValueError(
                "refine=DSnoTRefine needs feature_stats=(mean, var, sq_mean) from GramAccumulator.feature_stats"
            )

    def refine(
        self, weight: torch.Tensor, gram: torch.Tensor, start_mask: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> Refinement:
        if self.skip and ctx.name and f".{self.skip}." in ctx.name:
            return unrefined(weight, gram, start_mask)
        mean, var, sq_mean = ctx.feature_stats
        out = dsnot_refine(
            weight, start_mask, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean, nm=budget.nm,
            max_cycles=self.max_cycles, update_threshold=self.update_threshold,
        )  # fmt: skip
        loss_start = mask_losses(weight, gram, start_mask)
        return Refinement(out.mask, out.n_updates, out.n_cycles, None, loss_start, mask_losses(weight, gram, out.mask))


@dataclass(frozen=True)
class NoRefine(RefineStage):
    """The start mask is the final mask."""

    kind: ClassVar[str] = "none"
    names: ClassVar[tuple[str, ...]] = ("none",)

    def refine(
        self, weight: torch.Tensor, gram: torch.Tensor, start_mask: torch.Tensor, budget: Budget, ctx: StageContext
    ) -> Refinement:
        return unrefined(weight, gram, start_mask)


class WeightStage(Stage):
    """A weight stage: the final kept weights on the final mask.

    Class attributes:
        updates_weights: the final kept weights differ from the original ones.
        keeps_start_weights: the weights are the start's own (its mask unrefined).
        guard: a held-out guard (a field of the stages that update weights).
    """

    role: ClassVar[str] = "weight update"
    updates_weights: ClassVar[bool] = True
    keeps_start_weights: ClassVar[bool] = False
    guard: bool = False

    @property
    def wants_start_weights(self) -> bool:
        """The start should return its weights: this stage keeps them, or its guard falls back to them."""
        return self.keeps_start_weights or self.guard

    def fit(
        self,
        weight: torch.Tensor,
        gram: torch.Tensor,
        keep_mask: torch.Tensor,
        ctx: StageContext,
        *,
        start_weight: torch.Tensor | None = None,
        refined_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``[d_out, d_in]`` weights for ``keep_mask`` in ``weight``'s dtype and device (before the held-out guard),
        or None when the weights are kept. ``start_weight`` and ``refined_weight``: the weights the start
        (when :attr:`wants_start_weights`) and the refinement (the re-fit objective) computed, or None.

        By default: :meth:`solve` on the compute device (``ctx.device``, else the weight's), moved back."""
        compute = weight.device if ctx.device is None else torch.device(ctx.device)
        w = weight.to(compute)
        return self.solve(w, gram.to(compute), keep_mask.to(compute)).to(weight.device)

    def solve(self, weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        """The stage's weights for ``keep_mask``, with every tensor on one device (what :meth:`fit` calls)."""
        raise NotImplementedError(f"weight stage {self.name!r} defines neither fit nor solve")

    def describe(self, budget: Budget) -> str:
        return self.label + (" (guarded)" if self.guard else "")

    @property
    def label(self) -> str:
        """The stage in ``describe``'s line, before the guard."""
        return self.name


@dataclass(frozen=True)
class KeepWeights(WeightStage):
    """The kept weights stay as they are (the paper's SparseSwaps)."""

    kind: ClassVar[str] = "keep"
    names: ClassVar[tuple[str, ...]] = ("keep",)
    updates_weights: ClassVar[bool] = False

    def fit(
        self,
        weight: torch.Tensor,
        gram: torch.Tensor,
        keep_mask: torch.Tensor,
        ctx: StageContext,
        *,
        start_weight: torch.Tensor | None = None,
        refined_weight: torch.Tensor | None = None,
    ) -> None:
        return None


@dataclass(frozen=True)
class LeastSquares(WeightStage):
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
            ``lambda = damp * mean(diag G)``, shrinking towards zero (an earlier default, with the guard).

    The defaults (ridge ``"diag"``, damp 0.1, no guard) gave the best held-out perplexity on the default model at
    60%, 70% and 2:4 (RESULTS.md, "ADMM's ridge in our re-fit"); with this ridge the guard no longer helps.
    """

    kind: ClassVar[str] = "least_squares"
    names: ClassVar[tuple[str, ...]] = ("ls", "cg")
    solver: str = "direct"
    damp: float | None = None
    guard: bool = False
    ridge: str = REFIT_RIDGE

    def __post_init__(self) -> None:
        check_choice(self.solver, "least-squares solver", ("direct", "cg"))
        check_choice(self.ridge, "least-squares ridge", RIDGES)
        if self.damp is None:
            object.__setattr__(self, "damp", RIDGE_DAMPS[self.ridge])
        check_number(self.damp, "damp", low=0)
        check_bool(self.guard, "guard")

    @property
    def name(self) -> str:
        return "ls" if self.solver == "direct" else "cg"

    @classmethod
    def from_name(cls, name: str) -> LeastSquares:
        return cls(solver="direct" if name == "ls" else "cg")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.ridge} ridge {self.damp:g})"

    def fit(
        self,
        weight: torch.Tensor,
        gram: torch.Tensor,
        keep_mask: torch.Tensor,
        ctx: StageContext,
        *,
        start_weight: torch.Tensor | None = None,
        refined_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if refined_weight is not None:  # the re-fit objective's search already re-fitted these weights
            return refined_weight.to(device=weight.device, dtype=weight.dtype)
        return super().fit(weight, gram, keep_mask, ctx)

    def solve(self, weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        return refit_weights(weight, gram, keep_mask, damp=self.damp, ridge=self.ridge, solver=self.solver)


@dataclass(frozen=True)
class OBSUpdate(WeightStage):
    """SparseGPT's OBS weight update on the final mask (``core.sparsegpt.sparsegpt_prune(keep_mask=...)``).

    Attributes:
        damp: SparseGPT's relative dampening (``percdamp``).
        guard: as :class:`LeastSquares` (off by default: SparseGPT as published).
    """

    kind: ClassVar[str] = "obs"
    names: ClassVar[tuple[str, ...]] = ("obs",)
    rows_apart: ClassVar[str | None] = _OBS_ROWS
    damp: float = SPARSEGPT_DAMP
    guard: bool = False

    def __post_init__(self) -> None:
        check_number(self.damp, "damp", low=0)
        check_bool(self.guard, "guard")

    def solve(self, weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        return sparsegpt_prune(weight, gram, keep_mask=keep_mask, damp=self.damp).weight


@dataclass(frozen=True)
class ADMMUpdate(WeightStage):
    """ADMM's weight update on the final mask (``core.admm.admm_update``: the mask held fixed).

    Attributes:
        iters, rho, damp: as :class:`ADMMStart`; guard: as :class:`LeastSquares` (off: ADMM as published).
    """

    kind: ClassVar[str] = "admm_update"
    names: ClassVar[tuple[str, ...]] = ("admm",)
    rows_apart: ClassVar[str | None] = ADMMStart.rows_apart
    iters: int = admm.ADMM_ITERS
    rho: float = admm.ADMM_RHO
    damp: float = admm.ADMM_DAMP
    guard: bool = False

    def __post_init__(self) -> None:
        check_int(self.iters, "iters", low=0)
        check_number(self.rho, "rho", low=0)
        check_number(self.damp, "damp", low=0)
        check_bool(self.guard, "guard")

    def solve(self, weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        return admm_update(weight, gram, keep_mask, iters=self.iters, rho=self.rho, damp=self.damp)


@dataclass(frozen=True)
class ALPSUpdate(WeightStage):
    """ALPS's weight update on the final mask (``core.alps.alps_update``: ADMM on a fixed support, then
    conjugate gradients).

    Attributes:
        admm_iters, rho, cg_iters, cg_rtol, damp: as ``alps_update``; guard: as :class:`LeastSquares`.
    """

    kind: ClassVar[str] = "alps_update"
    names: ClassVar[tuple[str, ...]] = ("alps",)
    rows_apart: ClassVar[str | None] = ALPSStart.rows_apart
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
        check_bool(self.guard, "guard")

    def solve(self, weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
        return alps_update(
            weight, gram, keep_mask, admm_iters=self.admm_iters, rho=self.rho, cg_iters=self.cg_iters,
            cg_rtol=self.cg_rtol, damp=self.damp,
        )  # fmt: skip


@dataclass(frozen=True)
class StartWeights(WeightStage):
    """The weights the start computed for its own mask (SparseGPT's OBS, ADMM's, ALPS's): the published method.
    Only with a start that computes weights and no refinement (they fit the start mask only).

    Attributes:
        guard: as :class:`LeastSquares` (off: as published).
    """

    kind: ClassVar[str] = "start"
    names: ClassVar[tuple[str, ...]] = ("start",)
    keeps_start_weights: ClassVar[bool] = True
    guard: bool = False

    def __post_init__(self) -> None:
        check_bool(self.guard, "guard")

    def check(self, spec: PruneSpec) -> None:
        if not spec.start.computes_weights:
            raise ValueError(
                f"weights=StartWeights keeps the weights the start computed, but start {spec.start.name!r} "
                "computes none; use start='sparsegpt', 'admm' or 'alps', or another weight stage (e.g. "
                "weights='ls'; CLI --recipe sparseswaps-refit: Wanda -> SparseSwaps -> re-fit)"
            )
        if not isinstance(spec.refine, NoRefine):
            raise ValueError(
                "weights=StartWeights keeps the start's weights, which fit the start mask only, but the mask is "
                f"refined ({spec.refine.name}); use refine='none', or weights='ls', 'admm' or 'alps' for the refined "
                "mask"
            )

    def fit(
        self,
        weight: torch.Tensor,
        gram: torch.Tensor,
        keep_mask: torch.Tensor,
        ctx: StageContext,
        *,
        start_weight: torch.Tensor | None = None,
        refined_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return start_weight.to(device=weight.device, dtype=weight.dtype)


START_STAGES: tuple[type[StartStage], ...] = (ScoreStart, SparseGPTStart, ADMMStart, ALPSStart)
"""The built-in starts, in the order of their option names (:data:`~sparseswaps_prune.core.spec.STARTS`)."""
REFINE_STAGES: tuple[type[RefineStage], ...] = (SwapRefine, DSnoTRefine, NoRefine)
"""The built-in refiners."""
WEIGHT_STAGES: tuple[type[WeightStage], ...] = (
    KeepWeights, LeastSquares, OBSUpdate, ADMMUpdate, ALPSUpdate, StartWeights,
)  # fmt: skip
"""The built-in weight stages."""
WEIGHT_STARTS = tuple(cls for cls in START_STAGES if cls.computes_weights)
"""The starts that compute weights for their mask."""


def stage_names(table: tuple[type[Stage], ...]) -> tuple[str, ...]:
    """Every option name the stages of ``table`` answer to, in order."""
    return tuple(name for cls in table for name in cls.names)
