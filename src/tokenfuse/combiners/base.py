"""Combiner base class and registry: one small file per method, registered by name.

A combiner is bound once to a ``Setup`` (the members' ``VocabSpace``, the members, the primary
member) and then sees one step at a time through a ``StepView``: which members were computed for
which rows (sequences), their outputs (full log-probabilities, or only top-k for top-k combiners)
and the vocabulary space. It returns a ``Dist``: probabilities over union entries, either dense
(every union entry) or over a few candidate entries per row. The engine chooses from it.

Each combiner declares its parameters as a pydantic model (``Params``); ``get_combiner`` and
``validate_params`` check a method's parameters through it, so the config, the command line and
the server's per-request options report a bad parameter the same way (``params.<key>: ...``).

``AdaptiveParams`` are the adaptive options GaC and UniTE share (docs/methods.md, "Adaptive
combination"): per-step weights from each member's confidence (``confidence``, applied here, in
``Combiner.weights``), per-prompt weights from each member's likelihood of the prompt
(``prompt_weights``, PackLLM: the engine scores the prompt and hands the factors over in
``StepView.log_factors``) and selective ensembling (``select``, SAFE-style: the engine decides
which steps are ensembled, ``tokenfuse.engine.decide``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import Member, SeqState


@dataclass
class Dist:
    """A combined next-piece distribution for ``R`` rows.

    ``probs`` is ``float32[R, C]``. ``index`` is ``int64[R, C]``: the union entry of each column, or
    ``None`` when the columns are the union itself (``C == len(union)``). Padding columns have
    probability 0.
    """

    probs: torch.Tensor
    index: torch.Tensor | None = None

    def entry(self, row: int, col: int) -> int:
        return col if self.index is None else int(self.index[row, col])


@dataclass(frozen=True)
class Setup:
    """What a combiner is bound to (``Combiner.bind``), once per ensemble.

    Attributes:
        space: the members' vocabularies aligned on exact bytes.
        members: the members, in ``space.names`` order (their weights, ``score`` and, for DeePEn,
            their input embeddings).
        primary: index of the primary member.
        cache_dir: where a combiner may cache what it builds (``None``: nothing on disk).
    """

    space: VocabSpace
    members: Sequence[Member]
    primary: int = 0
    cache_dir: Path | None = None


def _untimed(_stage: str) -> AbstractContextManager:
    return nullcontext()


@dataclass
class StepView:
    """One step as a combiner sees it.

    Attributes:
        space: the members' vocabulary space (``union``, ``projector``, ``aligner``, ``codecs``).
        models: every member, in ensemble order (for ``token_logprobs``).
        states: per computed member, its ``SeqState`` of every row.
        members: the computed members (indices into ``models``), in ensemble order.
        weights: their raw weights.
        logprobs: full ``float32[R, V_i]`` log-probabilities per member (``needs == "full"``).
        topk: ``(logprobs float32[R, k], ids int64[R, k])`` per member (``needs == "topk"``).
        stage: the engine's stage timer (``stage("align")`` is a context manager).
        log_factors: per member, a per-row log weight factor ``float64[R]`` from the engine (PackLLM
            prompt weights); a member without one has factor 1.
    """

    space: VocabSpace
    models: Sequence[Member]
    states: dict[int, list[SeqState]]
    members: list[int]
    weights: list[float]
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stage: Callable[[str], AbstractContextManager] = _untimed
    log_factors: dict[int, torch.Tensor] = field(default_factory=dict)

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


class AdaptiveParams(BaseModel):
    """Adaptive options (GaC and UniTE; every one off by default).

    Attributes:
        select: selective ensembling (SAFE-style): the primary member's confidence threshold. Where
            its top probability is above it the primary's piece is taken and no other member runs
            (thresholded GaC with the primary as the gate); elsewhere every member runs, a piece they
            all rank first is taken (agreement skip) and the combination decides only where they
            disagree. ``0`` is the primary alone, ``1`` (with ``select_boundary: false``) plain
            combination. ``None``: off.
        select_boundary: with ``select``, never take the combination's piece where it is a strict
            prefix of some computed member's most likely token (the member holds a longer word as one
            token and would have to continue from a fragment of it): take the primary's most likely
            piece there instead.
        confidence: per-step weights: each member's weight times its confidence on that step,
            ``top`` its top probability, ``entropy`` ``exp(-H)`` of its next-token distribution (top-k
            methods: of its top-k, renormalised); ``none``: off.
        sharpness: the exponent ``β`` of the confidence: ``top^β`` or ``exp(-β·H)``.
        prompt_weights: PackLLM-sim per-prompt weights at temperature ``τ``: each member's weight
            times ``exp(ℓ_i / τ)``, ``ℓ_i`` its mean log-probability per UTF-8 byte of its own prompt
            (from the prefill). ``None``: off.
        prompt_bytes: with ``prompt_weights``, score only each member's ids that cover the prompt's
            last ``N`` bytes (the item-specific end of a few-shot prompt; the prefix before them is
            a plain prefill, which a cached prefix can serve). ``None``: the whole prompt.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    select: float | None = Field(None, ge=0, le=1)
    select_boundary: bool = True
    confidence: Literal["none", "top", "entropy"] = "none"
    sharpness: float = Field(1.0, ge=0)
    prompt_weights: float | None = Field(None, gt=0)
    prompt_bytes: int | None = Field(None, ge=1)


class Combiner(ABC):
    """Turns the computed members' outputs into one distribution over union entries.

    Class attributes:
        name: the registered method name.
        Params: the pydantic model of the method's parameters (``extra="forbid"``).
        needs: ``"full"`` (every member's whole distribution) or ``"topk"`` (only ``self.k`` most
            likely tokens per member plus log-probabilities of named ids: members that expose only
            top-k log-probabilities, such as remote servers, can take part).
        exact_agreement: with greedy decoding, when every computed member's most likely union
            entry is the same, the combined distribution's argmax is that entry, so the engine may
            skip alignment and combination for the step (agreement skip) without changing output.
    """

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    needs: ClassVar[str] = "full"
    exact_agreement: ClassVar[bool] = True
    k: int = 0

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def bind(self, setup: Setup) -> None:
        """Called once by the ensemble that uses the combiner (precompute tables here)."""
        self.space = setup.space

    def prepare(self, *, progress: bool = True) -> float:
        """Build or load what the combiner needs before the first step; returns seconds."""
        return 0.0

    @abstractmethod
    def combine(self, view: StepView) -> Dist:
        """The combined distribution for every row of ``view``."""

    @property
    def adaptive(self) -> AdaptiveParams | None:
        """The adaptive options, for a method that has them (``None`` otherwise)."""
        return self.params if isinstance(self.params, AdaptiveParams) else None

    def weights(self, view: StepView) -> list[tuple[int, float | torch.Tensor]]:
        """The computed members with a positive weight and their weights, not normalised: the
        configured weights (floats) or, with per-row factors (``view.log_factors``, ``confidence``),
        ``float64[R]`` per member, scaled so each row's largest is 1."""
        live = [(i, w) for i, w in zip(view.members, view.weights) if w > 0]
        opts = self.adaptive
        conf = opts is not None and opts.confidence != "none" and opts.sharpness > 0 and len(live) > 1
        if not conf and not any(i in view.log_factors for i, _ in live):
            return live
        logw = torch.zeros(view.rows, len(live), dtype=torch.float64)
        for k, (i, w) in enumerate(live):
            logw[:, k] = math.log(w)
            if i in view.log_factors:
                logw[:, k] += view.log_factors[i]
            if conf:
                logw[:, k] += opts.sharpness * log_confidence(view, i, opts.confidence)
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
        out = torch.zeros(view.rows, dtype=torch.float64)
        for i, w in normalise(self.weights(view)):
            lp = view.logprobs[i]
            text = space.projector.maps[i][: lp.shape[-1]] >= 0
            norm = torch.where(text, lp, torch.full_like(lp, float("-inf"))).logsumexp(-1)
            for r, e in enumerate(entries):
                ids = space.aligner.query_ids(i, e)
                if ids:
                    out[r] += (w if isinstance(w, float) else float(w[r])) * float((lp[r, ids] - norm[r]).exp().sum())
        return out

    def describe(self) -> dict[str, Any]:
        """The method and the parameters given explicitly (defaults left out)."""
        return {"method": self.name, **self.params.model_dump(exclude_unset=True)}


def log_confidence(view: StepView, i: int, kind: str) -> torch.Tensor:
    """Member ``i``'s log-confidence on each row, ``float64[R]``: ``top`` its highest log-probability,
    ``entropy`` minus the entropy of its next-token distribution (top-k: of its top-k, renormalised)."""
    if kind == "top":
        top = view.logprobs[i].max(-1).values if i in view.logprobs else view.topk[i][0][:, 0]
        return top.double()
    lp = view.logprobs[i].double() if i in view.logprobs else view.topk[i][0].double()
    lp = lp - lp.logsumexp(-1, keepdim=True)  # (full distributions already sum to 1)
    return (lp.exp() * lp).nan_to_num().sum(-1)  # -H; 0 * -inf counts 0


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
            out.add_(live[i][0] * w.to(out.dtype).unsqueeze(-1))
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


def _params(cls: type[Combiner], params: dict[str, Any]) -> BaseModel:
    try:
        return cls.Params.model_validate(params)
    except ValidationError as err:
        known = ", ".join(cls.Params.model_fields) or "none"
        lines = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                msg = f"unexpected keyword argument {key!r} (known: {known})"
            else:
                msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"params.{key}: {cls.name}: {msg}")
        raise ConfigError("; ".join(lines)) from None


def validate_params(method: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """Check ``params`` against method ``method``'s declared parameters; returns them as given
    (validated, defaults not filled in). Raises ``ConfigError`` naming ``method`` or ``params.<key>``."""
    cls = combiner_class(method)
    return _params(cls, dict(params or {})).model_dump(exclude_unset=True)


def get_combiner(name: str, **params: Any) -> Combiner:
    """A new combiner ``name`` with ``params`` (validated through its ``Params`` model)."""
    cls = combiner_class(name)
    return cls(_params(cls, params))
