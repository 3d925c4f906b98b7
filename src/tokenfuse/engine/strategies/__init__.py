"""The step decision's strategies (``base.Strategy``), registered in order: thresholded mode
(``gate``: a gate member, by default the primary, alone where it is sure), per-prompt weights (``prompt``), per-step confidence
weights (``confidence``) and SAFE (``safe``: drafted rounds, the ensemble triggered at clean
positions without consensus; sharpening); a
new one plugs in with ``register`` (after them). The order is the order of their hooks: gates
first, factors added to each member's log weight in this order (prompt, then confidence),
reshapes and revisions in turn."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tokenfuse.engine.strategies.base import Strategy
from tokenfuse.engine.strategies.confidence import Confidence
from tokenfuse.engine.strategies.gate import Gate
from tokenfuse.engine.strategies.prompt import PromptWeights
from tokenfuse.engine.strategies.safe import Safe

STRATEGIES: list[type[Strategy]] = []


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` one of the decision's strategies (after those registered before)."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or not getattr(cls, "name", None):
        raise TypeError(f"register: {cls!r} is not a named Strategy subclass")
    if any(s.name == cls.name for s in STRATEGIES if s is not cls):
        raise ValueError(f"register: a strategy named {cls.name!r} is already registered")
    if cls not in STRATEGIES:
        STRATEGIES.append(cls)
    return cls


for _builtin in (Gate, PromptWeights, Confidence, Safe):
    register(_builtin)


def strategy_params() -> tuple[type[BaseModel], ...]:
    """The ``params`` models the strategies declare (an adaptive combiner takes them besides its own)."""
    return tuple(s.Params for s in STRATEGIES if s.Params is not None)


def check_strategies(options: Any) -> None:
    """Every strategy's rules against ``options`` (an ``EnsembleOptions``)."""
    for s in STRATEGIES:
        s.check(options)


def build_strategies(options: Any) -> list[Strategy]:
    """The strategies ``options`` ask for, in ``STRATEGIES`` order (not bound yet)."""
    return [s(options) for s in STRATEGIES if s.wanted(options)]


__all__ = ["STRATEGIES", "Strategy", "build_strategies", "check_strategies", "register", "strategy_params"]
