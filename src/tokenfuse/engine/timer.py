"""Stage timing: where a step's time goes (``forward``, ``align``, ``combine``, ``choose``, ``resync``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

STAGES = ("forward", "align", "combine", "choose", "resync")


class StageTimer:
    """Seconds per stage, accumulated over the ensemble's life.

    ``with timer.stage("combine"):`` adds the block's wall time to ``totals["combine"]``. Stages nest:
    time spent in an inner stage (``align`` inside ``combine``, when a combiner projects a member)
    counts for the inner stage only, so the totals add up to the time spent in any stage.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._inner: list[float] = []  # per open stage: seconds spent in stages nested inside it

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            inner = self._inner.pop()
            self.totals[name] = self.totals.get(name, 0.0) + spent - inner
            if self._inner:
                self._inner[-1] += spent

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)

    def since(self, snapshot: dict[str, float], total: float) -> dict[str, float]:
        """Per stage the seconds since ``snapshot``, plus ``total`` (the caller's wall time) and
        ``other`` (what no stage covers)."""
        out = {k: self.totals[k] - snapshot.get(k, 0.0) for k in STAGES}
        out["total"] = total
        out["other"] = total - sum(out[k] for k in STAGES)
        return out
