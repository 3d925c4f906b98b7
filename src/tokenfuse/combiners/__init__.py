"""Combiners, registered by name (``tokenfuse.combiners.base.REGISTRY``)."""

# register "byte", "contrast", "deepen", "gac", "unite"
from tokenfuse.combiners import bytemix, contrast, deepen, gac, unite  # noqa: F401
from tokenfuse.combiners.base import (REGISTRY, Combiner, Dist, Setup, StepView, combiner_class, get_combiner,
                                      register, validate_params)

__all__ = ["REGISTRY", "Combiner", "Dist", "Setup", "StepView", "combiner_class", "get_combiner", "register",
           "validate_params"]
