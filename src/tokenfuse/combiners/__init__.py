"""Combiners, registered by name (``tokenfuse.combiners.base.REGISTRY``)."""

from tokenfuse.combiners import deepen, gac, unite  # noqa: F401  (register "deepen", "gac", "unite")
from tokenfuse.combiners.base import REGISTRY, Combiner, Dist, StepView, get_combiner, register

__all__ = ["REGISTRY", "Combiner", "Dist", "StepView", "get_combiner", "register"]
