"""The byte rows' numbers fit per task on its dev items (``byte-mix``'s weights, ``byte-gate``'s ``b`` and
``A``, ``byte-online``'s rate), never on test items: each member's byte model of ``context + gold continuation`` for the last
``FIT_ITEMS`` dev items in the seed's order (``auto`` and the primary's ranking take the first ones, so
the rows ``auto`` compares on dev are not scored on the items they were fit on, unless the pool is
smaller than both together) (``engine.bytescore.member_byte_logprobs``, the byte
method's default pruning), then EM on the gold continuations' bytes and the gate fit on them with its
features reading the context too (``combiners.mixers``). Likelihood-form tasks only (a generate-form
task's prompt is rendered by each member's own template: no bytes common to all); the others keep the
text fit (the bundled members' shipped one). Written as a fit file, ``--out/fits/<task>.json`` (read
again when resumed), the byte rows' ``params.fit``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.combiners.bytemix import ByteParams
from tokenfuse.combiners.mixers import best_rate, em_weights, fit_gate
from tokenfuse.engine.bytescore import member_byte_logprobs
from tokenfuse.progress import progress_bar
from tokenfuse.tasks.base import seeded_order

FIT_ITEMS = 50
ROWS = ("byte-mix", "byte-gate", "byte-online")  # the rows a task's fit holds


def task_fit(base, task, out: Path, seed: int, log: Callable[[str], None], items: int = FIT_ITEMS,
             progress: bool = True) -> Path | None:
    """The task's fit file (made once; the module docstring), ``None`` where the task has no dev items;
    ``progress``: a progress display over the members' byte models (``tokenfuse.progress``)."""
    path = out / "fits" / f"{task.name}.json"
    names = [m.name for m in base.members]
    if path.is_file():
        made = json.loads(path.read_text())
        if made.get("members") == names and set(made.get("fitted", {})) >= set(ROWS):
            return path  # else made before a row existed: made again (the same dev items, the same numbers)
    dev = seeded_order(task.dev_items(), seed)[-items:]
    if not dev:
        return None
    clozes = [task.cloze(it) for it in dev]
    log(f"dev {task.name}: fitting the byte rows on the gold options of {len(dev)} dev items")
    pruning = ByteParams().pruning
    live = [m for m, w in zip(base.members, base.weights) if w > 0]
    tables = {m.name: TokenBytes(m.codec.token_bytes) for m in live}
    with progress_bar(total=len(live) * len(clozes), desc=f"dev {task.name} byte fit", unit="byte model",
                      enabled=progress) as bar:
        def byte_model(m, c):
            lp = member_byte_logprobs(m, tables[m.name], pruning, c.context, [c.continuations[c.gold]])[0]
            bar.update(1)
            return lp
        lps = {m.name: [byte_model(m, c) for c in clozes] for m in live}
    texts = [np.exp(np.stack([lps[m.name][k] for m in live], axis=1)) for k in range(len(clozes))]
    starts = [len(c.context.encode("utf-8")) for c in clozes]
    with np.errstate(divide="ignore"):
        w = em_weights(np.log(np.concatenate([p[s:] for p, s in zip(texts, starts)])))
    gate = fit_gate(texts, w, starts)
    fit = {"task": "text-bytes", "members": [m.name for m in live], "from": f"{task.name} dev items",
           "dev_items": len(dev), **{k: v for k, v in ByteParams().model_dump().items()
                                     if k in ("keep", "width", "rule", "smooth")},
           "fitted": {"byte-mix": {"weights": w.tolist()}, "byte-gate": {"gate": gate.tolist()},
                      "byte-online": {"gate": gate.tolist(), "rate": best_rate(texts, gate, starts)}}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fit, indent=1) + "\n")
    log(f"dev {task.name}: byte-mix weights {', '.join(f'{m.name} {x:.3f}' for m, x in zip(live, w))}")
    return path
