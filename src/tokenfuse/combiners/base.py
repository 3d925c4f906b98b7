"""Combiner base class and registry: one small file per method, registered by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from difflib import get_close_matches
from typing import ClassVar

import torch

from tokenfuse.errors import ConfigError


class Combiner(ABC):
    """Turns the members' union-space distributions into one distribution over the union."""

    name: ClassVar[str]

    @abstractmethod
    def combine(self, probs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        """``probs``: per computed member ``float32[B, U]``; ``weights``: matching raw weights.

        Returns ``float32[B, U]``.
        """


REGISTRY: dict[str, type[Combiner]] = {}


def register(cls: type[Combiner]) -> type[Combiner]:
    REGISTRY[cls.name] = cls
    return cls


def get_combiner(name: str, **params) -> Combiner:
    if name not in REGISTRY:
        hint = get_close_matches(name, REGISTRY, n=1)
        raise ConfigError(
            f"method: unknown combiner {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" (available: {', '.join(sorted(REGISTRY))})"
        )
    return REGISTRY[name](**params)
