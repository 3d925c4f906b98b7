"""The lockstep engine: ``Ensemble`` (the facade), ``OpenSequence`` (one running sequence) and their values."""

from tokenfuse.engine.ensemble import Ensemble
from tokenfuse.engine.flags import StepCounts, StepFlags
from tokenfuse.engine.likelihood import Likelihood, RowMemo
from tokenfuse.engine.options import EnsembleOptions, SpeculativeOptions
from tokenfuse.engine.prompt import Prompt, TwoFormPrompt
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.sequence import Decision, Generation, OpenSequence, StepEvent

__all__ = ["Decision", "Ensemble", "EnsembleOptions", "Generation", "Likelihood", "OpenSequence", "Prompt", "RowMemo",
           "Sampling", "SpeculativeOptions", "StepCounts", "StepEvent", "StepFlags", "TwoFormPrompt"]
