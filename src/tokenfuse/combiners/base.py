"""Combiner base class and registry: one small file per method, registered by name.

A combiner is bound once to a ``Setup`` (the members' ``VocabSpace``, the members, the primary
member, the ensemble's weights and scores of its members) and then sees one step at a time through a ``StepView``: which members were computed for
which rows (sequences), their outputs (full log-probabilities, or only top-k for top-k combiners)
and the vocabulary space. It returns a ``Dist``: probabilities over union entries, either dense
(every union entry) or over a few candidate entries per row. The engine chooses from it.

A combiner whose step is one byte (``byte``, ``needs == "bytes"``) sees each member's next-byte
distribution instead, and its ``Dist`` is over the 256 bytes and the end (as their union entries);
it declares what the engine cannot do around such steps (``Combiner.lacks``: gating, speculative
decoding, the agreement skip, scoring pieces).

Each combiner declares its parameters as a pydantic model (``Params``); ``get_combiner`` and
``validate_params`` check a method's parameters through it, so the config, the command line and
the server's per-request options report a bad parameter the same way (``params.<key>: ...``).

A combiner that declares ``adaptive = True`` (GaC, UniTE) also takes the engine's adaptive
parameters (``boundary``, ``confidence``, ``prompt_weights``, ...) in its ``params``: they are
declared and run by the step decision's strategies (``tokenfuse.engine.strategies``), which hand a
combiner nothing but per-row weight factors (``StepView.log_factors``); ``validate_params``
checks them with the combiner's own through the models the caller passes (``extra``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from difflib import get_close_matches
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member, SeqState


# What the engine may do around a combiner's steps unless it lacks it (``Combiner.lacks``): thresholded
# mode, speculative decoding (and drafted rounds), the agreement skip, and scoring given pieces.
FEATURES = ("gate", "speculative", "agreement_skip", "scoring")


@dataclass
class Dist:
    """A combined next-piece distribution for ``R`` rows.

    ``probs`` is ``float32[R, C]`` (``float64`` for a step over bytes, ``needs == "bytes"``).
    ``index`` is ``int64[R, C]``: the union entry of each column, or ``None`` when the columns are the
    union itself (``C == len(union)``). Padding columns, and columns that stand for no union entry
    (``-1``: a byte no member holds as a token), have probability 0. ``terms``: named per-column
    numbers ``[R, C]`` the combiner computed the probabilities from (NaN where a column has none),
    which a traced step reports for the chosen piece (contrast: the expert's and the amateurs'
    log-probabilities and the score).
    """

    probs: torch.Tensor
    index: torch.Tensor | None = None
    terms: dict[str, torch.Tensor] = field(default_factory=dict)

    def entry(self, row: int, col: int) -> int:
        return col if self.index is None else int(self.index[row, col])


@dataclass(frozen=True)
class Setup:
    """What a combiner is bound to (``Combiner.bind``), once per ensemble.

    Attributes:
        space: the members' vocabularies aligned on exact bytes.
        members: the members, in ``space.names`` order (for DeePEn, their input embeddings).
        primary: index of the primary member.
        cache_dir: where a combiner may cache what it builds (``None``: nothing on disk).
        weights: the ensemble's weight of each member (``Ensemble.weights``; default: each member's
            own default ``weight``).
        scores: the ensemble's dev-set score of each member (``Ensemble.scores``, ``None``: unknown;
            DeePEn-Adapt reads them; default: none known).
    """

    space: VocabSpace
    members: Sequence[Member]
    primary: int = 0
    cache_dir: Path | None = None
    weights: Sequence[float] | None = None
    scores: Sequence[float | None] | None = None

    def __post_init__(self) -> None:
        if self.weights is None:
            object.__setattr__(self, "weights", [float(getattr(m, "weight", 1.0)) for m in self.members])
        if self.scores is None:
            object.__setattr__(self, "scores", [None] * len(self.members))


def _untimed(_stage: str) -> AbstractContextManager:
    return nullcontext()


@dataclass
class StepView:
    """One step as a combiner sees it.

    Attributes:
        space: the members' vocabulary space (``union``, ``projector``, ``aligner``, ``codecs``).
        models: every member, in ensemble order (for ``token_logprobs``).
        states: per computed member, its ``SeqState`` of every row.
        computed: the computed members (indices into ``models``), in ensemble order.
        weights: their raw weights (the ensemble's).
        logprobs: full ``float32[R, V_i]`` log-probabilities per member (``needs == "full"``); with
            ``needs == "bytes"`` each member's next-symbol distribution ``float64[R, 257]`` (natural
            logs of the bytes 0..255 and, at 256, the end: its byte-level view).
        topk: ``(logprobs float32[R, k], ids int64[R, k])`` per member (``needs == "topk"``).
        stage: the engine's stage timer (``stage("align")`` is a context manager).
        log_factors: per member, a per-row log weight factor ``float64[R]`` from the step decision's
            strategies (prompt weights, per-step confidence); a member without one has factor 1.
        argmax_only: only each row's most likely entry is taken from the distribution (greedy,
            untraced rows, nothing reshapes it): a combiner may return a ``Dist`` over a few
            candidate columns, provided each row's largest one is the whole distribution's argmax
            with no tie (``sparse_average``).
        allowed: ``bool[R, C]``, the outcomes the engine lets a step choose where it restricts them
            (a step over bytes: those that keep the output whole UTF-8 text), ``None`` otherwise; the
            combined distribution gives the others probability 0.
    """

    space: VocabSpace
    models: Sequence[Member]
    states: dict[int, list[SeqState]]
    computed: list[int]
    weights: list[float]
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stage: Callable[[str], AbstractContextManager] = _untimed
    log_factors: dict[int, torch.Tensor] = field(default_factory=dict)
    argmax_only: bool = False
    allowed: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(next(iter(self.states.values())))

    def project(self, i: int) -> torch.Tensor:
        """Member ``i``'s distribution mapped into the union (``float32[R, U]``), timed as alignment."""
        with self.stage("align"):
            return self.space.project(i, self.logprobs[i])

    def token_logprobs(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Member ``i``'s log-probabilities of named ids ``int64[R, n]`` (the member contract)."""
        return self.models[i].token_logprobs(self.states[i], ids)


class NoParams(BaseModel):
    """A method without parameters."""

    model_config = ConfigDict(extra="forbid")


class Combiner(ABC):
    """Turns the computed members' outputs into one distribution over union entries.

    Class attributes:
        name: the registered method name.
        Params: the pydantic model of the method's parameters (``extra="forbid"``).
        needs: what a step reads of each member: ``"full"`` (its whole next-token distribution),
            ``"topk"`` (only ``self.k`` most likely tokens plus log-probabilities of named ids: members
            that expose only top-k log-probabilities, such as remote servers, can take part) or
            ``"bytes"`` (its next-byte distribution, from its byte-level view read on its full rows:
            the step chooses one byte or the end, ``byte``; the engine's ``bytegen.ByteDecider``
            reads them).
        exact_agreement: with greedy decoding, when every computed member's most likely union
            entry is the same, the combined distribution's argmax is that entry, so the engine may
            skip alignment and combination for the step (agreement skip) without changing output.
            A combiner may set it per instance from its parameters (``contrast``: only for β = 0).
        adaptive: it takes the step decision's adaptive parameters (``tokenfuse.engine.strategies``)
            besides its own: its average takes per-row weights (``weights``).
        lacks: what the engine cannot do around the method's steps (``FEATURES``), each with the
            error a request for it gets. The options refuse ``gate`` and ``speculative``, scoring
            (``loglikelihood``, prompt logprobs) refuses ``scoring``, and a lacked ``agreement_skip`` is
            off even where the options set it; ``can`` and ``refuse`` ask.
        steps_per_token: how many of its steps one token of a length limit given in tokens stands for
            (``tokenfuse eval``'s per-task limits): 1, a byte step 4.
    """

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    needs: ClassVar[str] = "full"
    exact_agreement: ClassVar[bool] = True
    adaptive: ClassVar[bool] = False
    lacks: ClassVar[Mapping[str, str]] = {}
    steps_per_token: ClassVar[int] = 1
    k: int = 0

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    @classmethod
    def can(cls, feature: str) -> bool:
        """Whether the engine may do ``feature`` (one of ``FEATURES``) around this method's steps."""
        if feature not in FEATURES:
            raise ValueError(f"feature: expected one of {', '.join(FEATURES)}, got {feature!r}")
        return feature not in cls.lacks

    @classmethod
    def refuse(cls, feature: str) -> None:
        """Raise the ``ConfigError`` the method declares for ``feature`` where it lacks it (``lacks``)."""
        if not cls.can(feature):
            raise ConfigError(cls.lacks[feature])

    def bind(self, setup: Setup) -> None:
        """Called once by the ensemble that uses the combiner (precompute tables here)."""
        self.space = setup.space

    def prepare(self, *, progress: bool = True) -> float:
        """Build or load what the combiner needs before the first step; returns seconds."""
        return 0.0

    @abstractmethod
    def combine(self, view: StepView) -> Dist:
        """The combined distribution for every row of ``view``."""

    def weights(self, view: StepView) -> list[tuple[int, float | torch.Tensor]]:
        """The computed members with a positive weight and their weights, not normalised: the
        configured weights (floats) or, with per-row factors (``view.log_factors``), ``float64[R]``
        per member, scaled so each row's largest is 1."""
        live = [(i, w) for i, w in zip(view.computed, view.weights) if w > 0]
        if not any(i in view.log_factors for i, _ in live):
            return live
        logw = torch.zeros(view.rows, len(live), dtype=torch.float64)
        for k, (i, w) in enumerate(live):
            logw[:, k] = math.log(w)
            if i in view.log_factors:
                logw[:, k] += view.log_factors[i]
        w = (logw - logw.max(-1, keepdim=True).values).exp()
        return [(i, w[:, k]) for k, (i, _) in enumerate(live)]

    def piece_probs(self, view: StepView, entries: Sequence[int]) -> torch.Tensor:
        """Probability of a *given* union entry per row (teacher forcing, likelihood scoring).

        Default, for full-distribution combiners: the weighted average (``weights``) of each
        member's aligned probability of the entry (its own mass on those bytes, or on the first
        sub-token of them when it has no such token, as in UniTE), each member normalised over its
        text + END ids.
        """
        space = view.space
        out = None
        for i, w in normalise(self.weights(view)):
            lp = view.logprobs[i]
            aligned = space.aligner.aligned(i, torch.as_tensor(entries, dtype=torch.int64, device=lp.device))
            p = space.projector.probs(i, lp, aligned.unsqueeze(-1))[:, 0]
            term = p * (w if isinstance(w, float) else w.to(p.device))
            out = term if out is None else out + term.to(out.device)
        return out

    def describe(self) -> dict[str, Any]:
        """The method and the parameters given explicitly (defaults left out)."""
        return {"method": self.name, **self.params.model_dump(exclude_unset=True)}


def normalise(weights: Sequence[tuple[int, float | torch.Tensor]]) -> list[tuple[int, float | torch.Tensor]]:
    """``Combiner.weights`` divided by their sum (per row for per-row weights)."""
    if all(isinstance(w, float | int) for _, w in weights):
        total = sum(w for _, w in weights)
        return [(i, w / total) for i, w in weights]
    total = sum(torch.as_tensor(w, dtype=torch.float64) for _, w in weights)
    return [(i, torch.as_tensor(w, dtype=torch.float64) / total) for i, w in weights]


def weighted_average(probs: Sequence[torch.Tensor], weights: Sequence[float | torch.Tensor]) -> torch.Tensor:
    """``Σ w_i p_i / Σ w_i`` over members with positive weight (``p_i`` already normalised); a weight
    may be a float or ``float64[R]`` per row (``Combiner.weights``)."""
    if any(isinstance(w, torch.Tensor) for w in weights):
        live = [(p, w) for p, w in zip(probs, weights) if not isinstance(w, float | int) or w > 0]
        out = torch.zeros_like(live[0][0])
        for i, w in normalise([(k, w) for k, (_, w) in enumerate(live)]):
            out.add_(live[i][0] * w.to(out).unsqueeze(-1))
        return out
    total = float(sum(w for w in weights if w > 0))
    if total <= 0:
        raise ValueError("at least one computed member needs a positive weight")
    live = [(p, w) for p, w in zip(probs, weights) if w > 0]
    if len(live) == 1:
        return live[0][0]
    out = torch.zeros_like(live[0][0])
    for p, w in live:
        out.add_(p, alpha=w / total)
    return out


# ``sparse_average``: an entry is a candidate where some member gives one of its ids probability
# FLOOR or more; a row's best candidate must beat the bound on every other entry and its runner-up by
# the factor 1 + MARGIN (far above the float rounding by which the dense average can differ).
FLOOR, MARGIN = 0.01, 1e-4


def sparse_average(view: StepView, weights: Sequence[tuple[int, float | torch.Tensor]]) -> Dist | None:
    """``weighted_average`` of the projected members (``weights``: ``Combiner.weights``) over a few
    candidate entries, for a view that only wants each row's argmax (``StepView.argmax_only``); or
    ``None`` where that argmax is not certain (the caller then averages over the whole union).

    The candidates are the entries some member gives an id of probability ``FLOOR`` or more, or holds
    under several ids (``EntryProbs.head``). Any other entry's average is below the bound
    ``Σ w_i FLOOR / Z_i`` (normalised weights, ``Z_i`` member i's text + END mass). Where each row's
    best candidate exceeds the bound and its runner-up by the factor ``1 + MARGIN``, it is the argmax
    of the dense average too, which computes the same numbers (in float32, by the same rule) to a few
    units in the last place, without a tie; else ``None``. Costs one pass over each member's
    vocabulary (``EntryProbs.head``: its text mass and a threshold) instead of a projection into the
    whole union.
    """
    pj = view.space.projector
    live = normalise(weights)
    device = view.logprobs[live[0][0]].device
    heads = {i: pj.head(i, view.logprobs[i], FLOOR) for i, _ in live}
    cands = torch.unique(torch.cat([entries.to(device) for entries, _ in heads.values()]))
    if not cands.numel():
        return None
    total = bound = 0.0
    for i, w in live:
        logmass = heads[i][1].to(device)
        w = w if isinstance(w, float) else w.to(device)  # a per-row weight [R]
        per_entry = w if isinstance(w, float) else w[:, None]
        total = total + pj.close_probs(i, view.logprobs[i], cands, logmass) * per_entry
        bound = bound + FLOOR * w / logmass.exp()
    top = total.topk(min(2, total.shape[-1]), dim=-1).values
    second = top[:, 1] if top.shape[-1] > 1 else torch.zeros_like(top[:, 0])
    sure = (top[:, 0] > (1 + MARGIN) * bound) & (top[:, 0] > (1 + MARGIN) * second)
    if not bool(sure.all()):
        return None
    return Dist(total.float(), index=cands.expand(len(total), -1))


REGISTRY: dict[str, type[Combiner]] = {}


def register(cls: type[Combiner]) -> type[Combiner]:
    """Class decorator: make ``cls`` available as ``method: <cls.name>``."""
    if not (isinstance(cls, type) and issubclass(cls, Combiner)):
        raise TypeError(f"register: {cls!r} is not a Combiner subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: {cls.__name__} has no `name`")
    if name in REGISTRY and REGISTRY[name] is not cls:
        raise ValueError(f"register: method {name!r} is already registered by {REGISTRY[name].__name__}")
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, BaseModel)):
        raise TypeError(f"register: {cls.__name__}.Params must be a pydantic model")
    REGISTRY[name] = cls
    return cls


def combiner_class(name: str) -> type[Combiner]:
    """The registered combiner called ``name``; a ``ConfigError`` listing the others if none is."""
    if name not in REGISTRY:
        hint = get_close_matches(name, REGISTRY, n=1)
        raise ConfigError(
            f"method: unknown combiner {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" (available: {', '.join(sorted(REGISTRY))})"
        )
    return REGISTRY[name]


def _params(cls: type[Combiner], params: dict[str, Any], extra: Sequence[type[BaseModel]] = ()) -> BaseModel:
    model = _with_extra(cls.Params, tuple(extra)) if extra and cls.adaptive else cls.Params
    try:
        return model.model_validate(params)
    except ValidationError as err:
        known = ", ".join(model.model_fields) or "none"
        lines = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                msg = f"unexpected keyword argument {key!r} (known: {known})"
            else:
                msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"params.{key}: {cls.name}: {msg}")
        raise ConfigError("; ".join(lines)) from None


@lru_cache(maxsize=None)
def _with_extra(own: type[BaseModel], extra: tuple[type[BaseModel], ...]) -> type[BaseModel]:
    """One model of the ``extra`` parameters (the caller's adaptive ones, in order) and a combiner's
    own, so that every key is checked and an unknown one lists them all."""
    return type(own.__name__, (own, *reversed(extra)), {"model_config": ConfigDict(extra="forbid", allow_inf_nan=False)})


def validate_params(method: str, params: dict[str, Any] | None, *, extra: Sequence[type[BaseModel]] = ()) -> dict[str, Any]:
    """Check ``params`` against method ``method``'s declared parameters, and against ``extra``
    (the engine's adaptive parameters, for a combiner that declares ``adaptive``); returns them as
    given (validated, defaults not filled in). Raises ``ConfigError`` naming ``method`` or
    ``params.<key>``."""
    cls = combiner_class(method)
    return _params(cls, dict(params or {}), extra).model_dump(exclude_unset=True)


def get_combiner(name: str, **params: Any) -> Combiner:
    """A new combiner ``name`` with its own ``params`` (validated through its ``Params`` model)."""
    cls = combiner_class(name)
    return cls(_params(cls, params))
