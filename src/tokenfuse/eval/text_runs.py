"""The text runs by ``--tasks`` name (``tokenfuse eval --tasks text`` / ``text-bytes``): bits per byte of
held-out documents, one flow (``eval.text.run_text``) with the token-level rows (``eval.text.TokenRun``) or
the byte rows (``eval.text_bytes.ByteRun``)."""

from tokenfuse.eval.text import TextRun, TokenRun
from tokenfuse.eval.text_bytes import ByteRun

TEXT_RUNS: dict[str, type[TextRun]] = {run.task: run for run in (TokenRun, ByteRun)}
