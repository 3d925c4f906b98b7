"""Thresholded mode (GaC Eq. 5): a gate member runs every step; the others only where its top
probability is at or below the threshold. Its parameters are the options' ``gate`` (a member name)
and ``threshold``: each needs the other."""

from __future__ import annotations

from typing import Any

from tokenfuse.engine.strategies.base import Strategy
from tokenfuse.errors import ConfigError


class Gate(Strategy):
    name = "gate"

    @classmethod
    def wanted(cls, options: Any) -> bool:
        return options.gate is not None

    @classmethod
    def check(cls, options: Any) -> None:
        if options.threshold is not None and options.gate is None:
            raise ConfigError("gate: thresholded GaC needs a gate member (set `gate` to a member name)")
        if options.gate is not None and options.threshold is None:
            raise ConfigError(f"threshold: gate {options.gate!r} needs a threshold (ensemble where its top "
                              "probability is at or below it), e.g. threshold: 0.5")

    def gate(self) -> tuple[int, float]:
        return self.decider.space.names.index(self.options.gate), self.options.threshold
