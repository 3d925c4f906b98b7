"""The step decision's strategies (``base.Strategy``): thresholded mode (``gate``), selective
ensembling (``select``), per-prompt weights (``prompt``) and per-step confidence weights
(``confidence``). ``STRATEGIES`` is their order: gates first, then factors in the order they are
added to each member's log weight (prompt, then confidence)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tokenfuse.engine.strategies.base import Strategy
from tokenfuse.engine.strategies.confidence import Confidence
from tokenfuse.engine.strategies.gate import Gate
from tokenfuse.engine.strategies.prompt import PromptWeights
from tokenfuse.engine.strategies.select import Select

STRATEGIES: tuple[type[Strategy], ...] = (Gate, Select, PromptWeights, Confidence)


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


__all__ = ["STRATEGIES", "Strategy", "build_strategies", "check_strategies", "strategy_params"]
