"""Combiners, registered by name (``tokenfuse.combiners.base.REGISTRY``)."""

from tokenfuse.combiners import gac  # noqa: F401  (registers "gac")
from tokenfuse.combiners.base import REGISTRY, Combiner, get_combiner, register

__all__ = ["REGISTRY", "Combiner", "get_combiner", "register"]
