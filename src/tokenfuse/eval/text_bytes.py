"""Bits per byte of held-out text under the byte rows (``tokenfuse eval --tasks text-bytes``): every
member as a byte-level model (alignment/bytemodel.py), mixed byte by byte (the byte rows of engine/text_rows.py).

The run (``ByteRun`` in ``eval.text.run_text``'s flow), resumable (each document's numbers are kept under
``--out/bytes/`` as they are made):

1. the first ``DEV_PER_DOMAIN`` dev documents of each domain and every test document: each member's
   byte model of the document (``score_bytes`` with the run's ``Pruning``, its own tokens as the chain)
   and, from the same rows, the member alone on its own tokens (``single``);
2. the byte rows' weights, rate and gate fit on the dev documents (``text_rows.fit_bytes``), and
   ``doc-mix``'s weights (EM on the dev documents' ``single`` totals);
3. every row on every test document → ``items-text-bytes.jsonl``, ``results.json`` and ``results.md``
   as in the ``text`` run (``eval.text.aggregate``: against the best member and against ``doc-mix``,
   each family Holm-adjusted).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tokenfuse.alignment.bytemodel import Pruning
from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.alignment.byteview import score_bytes
from tokenfuse.combiners.mixers import Fitted
from tokenfuse.engine import text_rows
from tokenfuse.engine.text_features import Rows, primary_tokens
from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.text import (DEV_PER_DOMAIN, TextRun, cached, compare, doc_key, markdown, per_domain, score_entry,
                                 single_logprobs)
from tokenfuse.progress import progress_bar
from tokenfuse.tasks.text import Document, load_documents


def row_names(members: Sequence[Rows]) -> list[str]:
    """The ``text-bytes`` run's rows: each member alone and its byte model, ``doc-mix``, the byte rows."""
    return ([f"single:{m.name}" for m in members] + [f"bytes:{m.name}" for m in members] + ["doc-mix"]
            + list(text_rows.BYTE_ROWS))


def doc_bytes(members: Sequence[Rows], tokens: Sequence[TokenBytes], text: str, pruning: Pruning,
              on_member: Callable[[], object] | None = None) -> dict[str, np.ndarray]:
    """Each member's byte model of ``text`` (``q<i>``: natural-log probability of each byte) and its own
    tokens' log-probabilities (``single<i>``), with the rows each read (``rows``) and the seconds of
    each member's scoring (``seconds``); ``on_member`` is called after each member's (a progress bar)."""
    data = text.encode("utf-8")
    out: dict[str, np.ndarray] = {}
    read, seconds = [], []
    for i, (m, tb) in enumerate(zip(members, tokens)):
        t0 = time.perf_counter()
        own = primary_tokens(m.codec, text)
        with m.reader() as take:
            s = score_bytes(data, tb, m.start, take, chain=own, pruning=pruning)
        seconds.append(time.perf_counter() - t0)
        out[f"q{i}"] = s.logprobs
        out[f"single{i}"] = s.chain if s.chain is not None else np.zeros(0)
        read.append(s.rows)
        if on_member is not None:
            on_member()
    out["rows"] = np.array(read)
    out["seconds"] = np.array(seconds)
    return out


LEGACY = Pruning(keep=1e-2, width=1, rule="top", smooth=1e-6)  # a run's pruning from before it was recorded


def pruning_dict(pruning: Pruning) -> dict:
    return dataclasses.asdict(pruning)


def run_pruning(results: dict) -> Pruning:
    """The pruning a run's results.json records (a run from before the record: ``LEGACY``)."""
    if "rule" not in results:
        return LEGACY
    return Pruning(**{k: results[k] for k in pruning_dict(LEGACY) if k in results})


def _same_pruning(folder: Path, pruning: Pruning) -> None:
    """A run's views are all made with one pruning: recorded in ``bytes/pruning.json`` on the first start
    (a run from before the record: the top rule at the defaults of then), refused when resumed with
    another."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pruning.json"
    want = pruning_dict(pruning)
    if path.is_file():
        had = pruning_dict(Pruning(**json.loads(path.read_text())))
    elif any(folder.glob("*/*.npz")):
        had = pruning_dict(LEGACY)
    else:
        path.write_text(json.dumps(want) + "\n")
        return
    if had != want:
        flags = " ".join(f"--{k} {v if v is not None else 'none'}" for k, v in had.items() if k in ("keep", "width",
                                                                                                    "rule", "smooth", "fallback"))
        raise TokenfuseError(f"--out {folder.parent}: its byte views were made with {had}; resume it with the "
                             f"same pruning ({flags}) or give another --out")
    if not path.is_file():
        path.write_text(json.dumps(want) + "\n")


def _q(f: dict[str, np.ndarray], n: int) -> np.ndarray:
    return np.exp(np.stack([f[f"q{i}"] for i in range(n)], axis=1))


def doc_logprobs(f: dict[str, np.ndarray], names: Sequence[str], fitted: dict[str, Fitted]) -> dict[str, float]:
    """Every row's natural-log probability of one document from its ``doc_bytes``: ``single`` and
    ``bytes`` per member, ``doc-mix`` and each byte row in ``fitted``."""
    n = len(names)
    single = np.array([f[f"single{i}"].sum() for i in range(n)])
    lp = {f"single:{names[i]}": float(single[i]) for i in range(n)}
    lp |= {f"bytes:{names[i]}": float(f[f"q{i}"].sum()) for i in range(n)}
    lp["doc-mix"] = text_rows.doc_mix_logprob(single, fitted["doc-mix"].weights)
    q = _q(f, n)
    lp |= {row: float(text_rows.byte_logprobs(row, q, fitted[row]).sum()) for row in text_rows.BYTE_ROWS
           if row in fitted}
    return lp


def fit(dev: Sequence[dict[str, np.ndarray]], n: int) -> dict[str, Fitted]:
    """The byte rows' numbers and ``doc-mix``'s weights on the dev documents' ``doc_bytes``."""
    return (text_rows.fit_bytes([_q(f, n) for f in dev])
            | {"doc-mix": text_rows.fit_doc_mix(np.array([[f[f"single{i}"].sum() for i in range(n)] for f in dev]))})


def dev_fit(out: Path, names: Sequence[str], data: str | None = None, dev_per_domain: int = DEV_PER_DOMAIN) -> dict:
    """A fit file from a ``text-bytes`` run's dev views alone (``--out``'s ``bytes/dev``; no test document
    read): the shape of its results.json's ``task``, ``members``, pruning and ``fitted`` (what the ``byte``
    method's ``params.fit`` and ``tokenfuse score --bytes --fitted`` read)."""
    dev = per_domain(load_documents("dev", data), dev_per_domain)
    paths = [out / "bytes" / "dev" / f"{doc_key(d)}.npz" for d in dev]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise TokenfuseError(f"{out}: {len(missing)} of its {len(dev)} dev documents have no byte view yet "
                             f"(first: {missing[0]}); run tokenfuse eval --tasks text-bytes --out {out} first")
    dev_f = [dict(np.load(p)) for p in paths]
    if any(f"q{len(names) - 1}" not in f or f"q{len(names)}" in f for f in dev_f):
        raise TokenfuseError(f"{out}: its views are not of {len(names)} members ({', '.join(names)})")
    pruning = Pruning(**json.loads((out / "bytes" / "pruning.json").read_text()))
    return {"task": "text-bytes", "members": list(names), **pruning_dict(pruning),
            "fitted": {row: p.as_dict() for row, p in fit(dev_f, len(names)).items()},
            "dev_documents": len(dev), "dev_bytes": sum(d.nbytes for d in dev)}


class ByteRun(TextRun):
    """``--tasks text-bytes``: every member's byte model and the byte rows (the module docstring)."""

    task, predicts, stages = "text-bytes", "bytes", ("dev_bytes", "test_bytes")

    def prepare(self, dev: Sequence[Document]) -> tuple[dict, dict[str, float]]:
        _same_pruning(self.out / "bytes", self.settings.pruning)
        return {"primary": "none (byte rows)", **pruning_dict(self.settings.pruning)}, {}

    def numbers(self, docs: Sequence[Document], split: str) -> list[dict[str, np.ndarray]]:
        tokens = [TokenBytes(m.codec.token_bytes) for m in self.members]
        return cached(self.out / "bytes" / split, docs,
                      lambda d: doc_bytes(self.members, tokens, d.text, self.settings.pruning), dict, dict,
                      self.settings.progress, f"text-bytes {split}: {len(self.members)} members' byte views", split)

    def fit(self, dev: Sequence[dict[str, np.ndarray]]) -> dict[str, Fitted]:
        return fit(dev, len(self.members))

    def rows(self) -> list[str]:
        return row_names(self.members)

    def logprobs(self, f: dict[str, np.ndarray], fitted: dict[str, Fitted]) -> dict[str, float]:
        return doc_logprobs(f, self.names, fitted)

    def record(self, f: dict[str, np.ndarray]) -> dict:
        return {"rows_read": f["rows"].tolist()}

    def finish(self, results: dict, records: Sequence[dict]) -> dict:
        return super().finish(results, records) | {"vs_best_view": versus_views(records, self.names)}

    @staticmethod
    def render(results: dict) -> str:
        return markdown(results) + views_markdown(results["vs_best_view"])


def versus_views(records: Sequence[dict], names: Sequence[str]) -> dict:
    """Each byte row against the best ``bytes:`` row pooled (a member's own byte view, the harder
    comparison): ``compare``'s gain, interval and p-value, not Holm-adjusted (one family: the byte rows)."""
    bits = {row: np.array([r["bits"][row] for r in records]) for row in records[0]["bits"]}
    best = min((f"bytes:{m}" for m in names), key=lambda row: bits[row].sum())
    return {row: compare(bits[row], bits[best]) | {"best": best} for row in text_rows.BYTE_ROWS}


def views_markdown(vs: dict) -> str:
    """The lines of ``results.md`` for ``versus_views``."""
    lines = ["", "Pooled, against the best member's own byte view:", ""]
    for row, c in vs.items():
        lines.append(f"- `{row}` against `{c['best']}`: {100 * c['gain']:+.2f} % "
                     f"[{100 * c['ci'][0]:+.2f}, {100 * c['ci'][1]:+.2f}], p = {c['p']:.4g}")
    return "\n".join(lines) + "\n"


def score_texts(members: Sequence[Rows], texts: Sequence[str], fitted: dict[str, Fitted], pruning: Pruning, *,
                progress: bool = True) -> list[dict]:
    """``tokenfuse score --bytes``: every row of this run (those in ``fitted`` of the byte rows) on each
    text, in ``score``'s ``--json`` shape per text, with what each member's byte model cost: the rows it
    read and its seconds, beside the seconds of the member's own scoring of the same text
    (``members``)."""
    names = [m.name for m in members]
    tokens = [TokenBytes(m.codec.token_bytes) for m in members]
    sizes = [len(t.encode("utf-8")) for t in texts]
    out = []
    with progress_bar(total=len(members) * sum(sizes), desc="byte models", unit="B", enabled=progress) as bar:
        for text, size in zip(texts, sizes):
            f = doc_bytes(members, tokens, text, pruning, on_member=lambda size=size: bar.update(size))
            lps = doc_logprobs(f, names, fitted)
            cost = {}
            for i, m in enumerate(members):
                t0 = time.perf_counter()
                single_logprobs(m, text)
                cost[m.name] = {"rows": int(f["rows"][i]), "view_seconds": round(float(f["seconds"][i]), 3),
                                "own_seconds": round(time.perf_counter() - t0, 3)}
            out.append({"bytes": size, "rows": {row: score_entry(lp, size) for row, lp in lps.items()},
                        "members": cost})
    return out
