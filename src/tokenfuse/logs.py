"""Third-party log lines through Python ``logging``, silent unless logging is turned up.

``tokenfuse --verbose`` (or ``TOKENFUSE_LOG=debug``) sends every record at DEBUG and above to
standard error; without it nothing configures a handler and these lines go nowhere. llama.cpp's
lines are routed where llama.cpp is imported (logger ``tokenfuse.llama_cpp``,
``tokenfuse.members.llamacpp_lib``); transformers' by ``route_transformers_logs``, called by whatever is
about to use transformers (it imports transformers, so never on the llama.cpp path).
"""

from __future__ import annotations

import logging

from tokenfuse.progress import on_terminal

_SILENT = logging.NullHandler()  # handles the records nothing else does (instead of logging's last resort)


def route_transformers_logs() -> None:
    """Send transformers' log lines (logger ``transformers``) through Python logging instead of its
    own standard-error handler, and turn its progress bars (and huggingface_hub's) off when
    standard error is not a terminal. Its level stays transformers' (``TRANSFORMERS_VERBOSITY``,
    which the command line sets to ``error``, or ``debug`` with ``--verbose``). Idempotent."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    logging.getLogger("transformers").addHandler(_SILENT)  # adding the same handler twice is a no-op
    if not on_terminal():
        hf_logging.disable_progress_bar()
