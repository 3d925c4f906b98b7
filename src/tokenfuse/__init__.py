"""tokenfuse: several LLMs with different tokenizers generating as one model, token by token."""

from tokenfuse.engine import Ensemble, Generation, OpenSequence, StepEvent, TwoFormPrompt
from tokenfuse.engine.sampling import Sampling
from tokenfuse.errors import ConfigError, ModelNotInstalledError, TokenfuseError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Ensemble",
    "Generation",
    "ModelNotInstalledError",
    "OpenSequence",
    "Sampling",
    "StepEvent",
    "TokenfuseError",
    "TwoFormPrompt",
    "__version__",
]
