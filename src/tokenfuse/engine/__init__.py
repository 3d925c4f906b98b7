"""The lockstep engine: ``Ensemble`` (the facade), ``OpenSequence`` (one running sequence) and their values."""

from tokenfuse.engine.ensemble import Ensemble
from tokenfuse.engine.likelihood import Likelihood, RowMemo
from tokenfuse.engine.options import EnsembleOptions, SpeculativeOptions
from tokenfuse.engine.prompt import Prompt, TwoFormPrompt
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.sequence import Decision, Generation, OpenSequence, StepEvent

__all__ = ["Decision", "Ensemble", "EnsembleOptions", "Generation", "Likelihood", "Prompt", "RowMemo", "Sampling",
           "OpenSequence", "SpeculativeOptions", "StepEvent", "TwoFormPrompt"]
