"""DeePEn (Huang et al. 2024): the relative space (``relative``), its row store (``rows``) and the
engine adapter (``combiner``, registered as ``deepen``)."""

from tokenfuse.combiners.deepen.combiner import DeePEnCombiner

__all__ = ["DeePEnCombiner"]
