"""The step decision's adaptive rules as strategies: each a small unit with its parameters beside its code.

The decision (``tokenfuse.engine.decide.Decider``) orchestrates a step — groups → agreement skip →
weight factors → combination → choice → revision — and asks its strategies through these hooks
only (each a no-op by default):

* ``gate()``: ``(member, threshold)``: where that member's top probability is above the threshold,
  it alone decides the row and no other member runs (at most one strategy gates);
* ``prepare(seqs)``: before the sequences' first forward (PackLLM scores each prompt: its prefill);
* ``factors(view, seqs)``: per-row log weight factors for the combiner (``StepView.log_factors``);
* ``reshape(dist)``: change the combined distribution before the choice (generation only; SAFE's
  probability sharpening);
* ``revise(seqs, members, outs, chosen)``: change chosen entries after the choice; returns the rows
  it changed (counted as ``vetoed`` steps);
* ``admit(s)``: when a sequence is opened, raise ``ConfigError`` where it cannot run (SAFE: sampling).

Drafted rounds (SAFE): a strategy whose ``chunk()`` is a number has generation run in rounds
(``tokenfuse.engine.speculative.Speculator``): the primary member drafts that many pieces, the
other members' rows at every drafted position come from one chunked forward, and the positions are
examined in order; ``trigger(s, draft, rows)`` says whether the ensemble decides the first of
``draft`` (the round's drafted entries from this position on) — the decision is then the step's
own (``Decider.decide_given``) and ends the round — or the drafted piece is taken as it is (not
ensembled). At most one strategy drafts.

A strategy declares ``Params`` (its keys in the method's ``params``, checked together with the
combiner's own by ``combiners.validate_params``), ``check(options)`` (its rules against the other
options, checked once, when the options are validated) and ``wanted(options)`` (whether the options
ask for it). ``prefills``: its ``prepare`` feeds prompts in calls of its own (scoring cannot share
rows); ``speculative``: it allows speculative and drafted rounds; ``exact_agreement``: the
agreement skip stays exact under its ``reshape`` (SAFE's sharpening: it does not, so the skip is off
unless set).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel

from tokenfuse.alignment.space import VocabSpace
from tokenfuse.combiners.base import Dist, StepView
from tokenfuse.engine.pool import MemberOutput, MemberPool
from tokenfuse.engine.sequence import OpenSequence
from tokenfuse.members.base import Member


class DecisionContext(Protocol):
    """What a strategy may use of the decision that binds it (``Decider``)."""

    members: list[Member]
    space: VocabSpace
    primary: int
    pool: MemberPool
    timer: Any  # ``StageTimer``: ``timer.stage(name)`` is a context manager
    strategies: list[Strategy]
    gate: int | None

    def computed(self) -> list[int]: ...

    def forward(self, which: list[int], seqs: list[OpenSequence], *, trace_k: int = 0) -> dict[int, MemberOutput]: ...

    def primary_top(self, seqs: list[OpenSequence], outs: dict[int, MemberOutput]) -> list[int]: ...


class Strategy:
    """One adaptive rule of the step decision (see the module docstring)."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel] | None] = None
    prefills: ClassVar[bool] = False
    speculative: ClassVar[bool] = True
    exact_agreement: bool = True

    def __init__(self, options: Any) -> None:
        self.options = options
        self.params = self.Params.model_validate(_own(self.Params, options.params)) if self.Params else None

    @classmethod
    def wanted(cls, options: Any) -> bool:
        """Whether ``options`` (an ``EnsembleOptions``) ask for this strategy."""
        return False

    @classmethod
    def check(cls, options: Any) -> None:
        """Raise ``ConfigError`` (naming the field) where ``options`` contradict this strategy."""

    def bind(self, decider: DecisionContext) -> None:
        """Called once by the decision that uses the strategy."""
        self.decider = decider

    def gate(self) -> tuple[int, float] | None:
        return None

    def prepare(self, seqs: list[OpenSequence]) -> None:
        """Before a forward of ``seqs``."""

    def factors(self, view: StepView, seqs: list[OpenSequence] | None) -> dict[int, torch.Tensor]:
        """Per computed member, a per-row log weight factor ``float64[R]`` (none: ``{}``)."""
        return {}

    def reshape(self, dist: Dist) -> Dist:
        """The combined distribution the choice is made from (``dist``: the combiner's)."""
        return dist

    def revise(self, seqs: list[OpenSequence], members: list[int], outs: dict[int, MemberOutput],
               chosen: dict[int, int]) -> set[int]:
        """Change ``chosen`` (row -> union entry) in place; the rows changed."""
        return set()

    def admit(self, s: OpenSequence) -> None:
        """Raise ``ConfigError`` (naming the field) where ``s`` (just opened) cannot run under this strategy."""

    def chunk(self) -> int | None:
        """Pieces the primary drafts per round (``None``: no drafted rounds; module docstring)."""
        return None

    def trigger(self, s: OpenSequence, draft: list[int], rows: dict[int, torch.Tensor]) -> bool:
        """In a drafted round, with ``s`` at a drafted position: whether the ensemble decides it.
        ``draft``: the round's drafted union entries from this position on; ``rows``: every member
        that may decide (``computed()`` and the primary), its log-probabilities ``float32[V]`` here."""
        return True


def _own(model: type[BaseModel], params: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``params`` that ``model`` declares."""
    return {k: v for k, v in params.items() if k in model.model_fields}


def param(options: Any, model: type[BaseModel], key: str) -> Any:
    """``options.params[key]``, or the default ``model`` declares for it."""
    return options.params.get(key, model.model_fields[key].default)
