"""Bits per byte of held-out text under every row (``tokenfuse eval --tasks text``) and of a user's
own files (``tokenfuse score``).

One flow for both text runs (``run_text``; ``text`` and ``text-bytes`` differ only in their ``TextRun``:
what a document's numbers are, how the rows are fit and scored). The ``text`` run (``TokenRun``),
resumable (each document's numbers are kept under ``--out`` as they are made):

1. each member alone on the first ``CHOOSE_PER_DOMAIN`` dev documents of each domain (``single``); the
   **primary** is the member with the fewest bits per byte pooled over them (or ``--primary``);
2. the first ``DEV_PER_DOMAIN`` dev documents of each domain and every test document: their
   ``DocFeatures`` with that primary (one pass of each member);
3. the rows' weights and rates fit on dev (``engine.text_rows.fit``);
4. every row on every test document → ``items-text.jsonl`` (bits and bytes per document and row),
   ``results.json`` and ``results.md``: bits per byte per domain and pooled, and each row that is not a
   member against the best member on the same documents (``vs_best``: ``gain`` = 1 − bits(row) /
   bits(best), a paired bootstrap interval over documents, a paired sign-flip p-value, Holm over
   the table), and each token-level row against ``doc-mix`` the same way (``vs_doc_mix``, its own
   Holm family).
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenfuse.alignment.bytemodel import Pruning
from tokenfuse.combiners.mixers import Fitted
from tokenfuse.engine import text_rows
from tokenfuse.engine.text_features import DocFeatures, Rows, doc_features, primary_tokens
from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.batches import stderr_log
from tokenfuse.eval.stats import holm
from tokenfuse.paths import save_npz
from tokenfuse.progress import progress_bar
from tokenfuse.tasks.text import Document, load_documents

LN2 = math.log(2)
RESAMPLES = 1000
FLIPS = 20000
SEED = 0
DEV_PER_DOMAIN = 5
CHOOSE_PER_DOMAIN = 2


def per_domain(docs: Sequence[Document], n: int | None) -> list[Document]:
    """The first ``n`` documents of each domain, in file order (all with ``None``)."""
    seen: dict[str, int] = {}
    out = []
    for d in docs:
        seen[d.domain] = seen.get(d.domain, 0) + 1
        if n is None or seen[d.domain] <= n:
            out.append(d)
    return out


@dataclass
class TextSettings:
    out: str = "eval-out"
    data: str | None = None
    limit: int | None = None  # test documents (file order; default all)
    dev_per_domain: int | None = DEV_PER_DOMAIN  # dev documents of each domain the rows are fit on (None: all)
    choose_per_domain: int = CHOOSE_PER_DOMAIN  # of those, the ones each member alone is scored on to choose the primary
    primary: str | None = None
    progress: bool = True
    pruning: Pruning = field(default_factory=Pruning)  # the text-bytes run's byte models


def doc_key(doc: Document) -> str:
    return hashlib.sha1(doc.id.encode()).hexdigest()[:16]


def single_logprobs(member: Rows, text: str) -> np.ndarray:
    """A member alone: the natural-log probability of each of its own tokens of ``text`` after its start token."""
    own = primary_tokens(member.codec, text)
    if not own:
        return np.zeros(0)
    return member.logprobs_of([member.start + own[:j] for j in range(len(own))], own)


def _bits(logprob: float) -> float:
    return -logprob / LN2


def score_entry(logprob: float, nbytes: int) -> dict[str, float]:
    """One row of ``tokenfuse score --json`` for a text of ``nbytes`` bytes: its bits and bits per byte."""
    return {"bits_per_byte": _bits(logprob) / max(nbytes, 1), "bits": _bits(logprob)}


def cached(folder: Path, docs: Sequence[Document], make: Callable[[Document], Any], arrays: Callable[[Any], dict],
           load: Callable[[Any], Any], progress: bool, label: str, split: str) -> list:
    """Each document's numbers (``make``), kept in ``folder`` as they are made (``arrays``: an ``.npz``'s
    arrays of them; ``load``: the numbers from the ``.npz`` file) and read back when a run resumes;
    ``label`` starts the log line, ``split`` names the progress bar."""
    folder.mkdir(parents=True, exist_ok=True)
    got = [load(np.load(p)) if (p := folder / f"{doc_key(d)}.npz").is_file() else None for d in docs]
    todo = [k for k, g in enumerate(got) if g is None]
    stderr_log(f"{label} on {len(docs)} documents ({sum(d.nbytes for d in docs):,} bytes; "
               f"{len(docs) - len(todo)} already done)")
    with progress_bar(total=len(docs), initial=len(docs) - len(todo), desc=f"{split} documents", unit="doc",
                      enabled=progress) as bar:
        for k in todo:
            got[k] = make(docs[k])
            save_npz(folder / f"{doc_key(docs[k])}.npz", **arrays(got[k]))
            bar.update(1)
    return got


def publish(out: Path, task: str, records: Sequence[dict], results: dict, render: Callable[[dict], str]) -> dict:
    """A run's items (``items-<task>.jsonl``), ``results.json`` and ``results.md`` (``render``); returns the results."""
    with (out / f"items-{task}.jsonl").open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(render(results))
    return results


def _add_seconds(out: Path, now: dict[str, float]) -> dict[str, float]:
    """Each stage's seconds summed over every invocation of the run (``seconds.json``): a resumed run
    adds what it spent, so the record stays the run's whole cost."""
    path = out / "seconds.json"
    total = json.loads(path.read_text()) if path.is_file() else {}
    total = {k: round(total.get(k, 0.0) + v, 1) for k, v in now.items()}
    path.write_text(json.dumps(total) + "\n")
    return total


def row_names(members: Sequence[Rows]) -> list[str]:
    """The ``text`` run's rows: each member alone, then ``text_rows.TEXT_ROWS``."""
    return [f"single:{m.name}" for m in members] + list(text_rows.TEXT_ROWS)


def compare(row_bits: np.ndarray, best_bits: np.ndarray) -> dict:
    """``gain`` = 1 − Σ row / Σ best over paired documents, its bootstrap interval and a sign-flip p-value."""
    gain = 1.0 - row_bits.sum() / best_bits.sum()
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, row_bits.size, size=(RESAMPLES, row_bits.size))
    gains = 1.0 - row_bits[idx].sum(axis=1) / best_bits[idx].sum(axis=1)
    lo, hi = np.quantile(gains, [0.025, 0.975])
    d = best_bits - row_bits
    flips = rng.choice((-1.0, 1.0), size=(FLIPS, d.size))
    extreme = np.sum(np.abs(flips @ d) >= abs(d.sum()) - 1e-9)
    return {"gain": round(float(gain), 5), "ci": [round(float(lo), 5), round(float(hi), 5)],
            "p": float((1 + extreme) / (1 + FLIPS))}


def aggregate(records: Sequence[dict], rows: Sequence[str], members: Sequence[str], *,
              versus_doc_mix: Sequence[str] = text_rows.TOKEN_ROWS) -> dict:
    """Bits per byte per domain and pooled, ``vs_best`` for every row that is not a member (the best
    ``single:`` row), and ``vs_doc_mix`` for the rows in ``versus_doc_mix``."""
    domains = sorted({r["domain"] for r in records})
    groups = {d: [r for r in records if r["domain"] == d] for d in domains} | {"pooled": list(records)}
    out: dict = {row: {"bpb": {}, "vs_best": {}} for row in rows}
    best_of: dict[str, str] = {}
    for g, recs in groups.items():
        nbytes = sum(r["bytes"] for r in recs)
        bits = {row: np.array([r["bits"][row] for r in recs]) for row in rows}
        for row in rows:
            out[row]["bpb"][g] = round(float(bits[row].sum() / nbytes), 5)
        best = min((f"single:{m}" for m in members), key=lambda row: bits[row].sum())
        best_of[g] = best
        for row in rows:
            if not row.startswith("single:"):
                out[row]["vs_best"][g] = compare(bits[row], bits[best]) | {"best": best}
        if "doc-mix" in rows:
            for row in rows:
                if row in versus_doc_mix:
                    out[row].setdefault("vs_doc_mix", {})[g] = compare(bits[row], bits["doc-mix"])
    for key in ("vs_best", "vs_doc_mix"):  # two families, each Holm-adjusted on its own
        family = [(row, g) for row in rows for g in groups if g in out[row].get(key, {})]
        adjusted = holm([out[row][key][g]["p"] for row, g in family])
        for (row, g), p in zip(family, adjusted):
            out[row][key][g]["p_holm"] = p
    return {"rows": out, "best_member": best_of, "domains": domains,
            "documents": {g: len(recs) for g, recs in groups.items()},
            "bytes": {g: sum(r["bytes"] for r in recs) for g, recs in groups.items()}}


CAPTION = "Bits per byte of the test documents"


def markdown(results: dict) -> str:
    """``results.md`` of a ``text`` run: bits per byte per domain and pooled (documents in brackets); for a
    row that is not a member, its gain over the best member on those documents in percent (‡: Holm-adjusted
    p < 0.05)."""
    groups = results["domains"] + ["pooled"]
    head = "| row | " + " | ".join(f"{g} ({results['documents'][g]})" for g in groups) + " |"
    lines = [f"{CAPTION} (fewer is better; in brackets the gain over the best member, ‡ Holm p < 0.05), "
             f"primary {results['primary']}:", "", head, "|---" * (len(groups) + 1) + "|"]
    for row, r in results["rows"].items():
        cells = []
        for g in groups:
            cell = f"{r['bpb'][g]:.4f}"
            vs = r["vs_best"].get(g)
            if vs is not None:
                mark = "‡" if vs["p_holm"] < 0.05 else ""
                cell += f" ({vs['gain'] * 100:+.1f} %{mark})"
            cells.append(cell)
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


class TextRun(abc.ABC):
    """One kind of text run (``--tasks text`` or ``text-bytes``): what each document's numbers are, how its
    rows are fit on the dev documents' numbers and what each row gives a document. ``run_text`` is the
    one flow both follow."""

    task: str
    predicts: str  # what its mixtures of the members predict (``text_rows.Row.predicts``): compared with doc-mix
    stages: tuple[str, str]  # seconds.json's names of the dev and test documents' numbers

    def __init__(self, members: Sequence[Rows], settings: TextSettings) -> None:
        self.members, self.settings = list(members), settings
        self.names = [m.name for m in members]
        self.out = Path(settings.out)

    @abc.abstractmethod
    def prepare(self, dev: Sequence[Document]) -> tuple[dict, dict[str, float]]:
        """Before the numbers: results.json's entries after ``primary`` and seconds spent (by stage)."""

    @abc.abstractmethod
    def numbers(self, docs: Sequence[Document], split: str) -> list:
        """Each document's numbers, kept under ``--out`` as they are made (``cached``)."""

    @abc.abstractmethod
    def fit(self, dev: Sequence) -> dict[str, Fitted]:
        """Every row's parameters from the dev documents' numbers (nothing else)."""

    @abc.abstractmethod
    def rows(self) -> list[str]:
        """The run's rows, in results' order."""

    @abc.abstractmethod
    def logprobs(self, f, fitted: dict[str, Fitted]) -> dict[str, float]:
        """Every row's natural-log probability of one document from its numbers, in ``rows()``' order."""

    def record(self, f) -> dict:
        """A test document's record entries besides its id, domain, bytes and bits."""
        return {}

    def finish(self, results: dict, records: Sequence[dict]) -> dict:
        """results.json from the run's entries and its records."""
        versus = tuple(r for r, x in text_rows.ROWS.items() if x.predicts == self.predicts)
        return results | aggregate(records, self.rows(), self.names, versus_doc_mix=versus)

    @staticmethod
    def render(results: dict) -> str:
        """``results.md`` from ``results.json`` (also ``eval.pages``' rendering)."""
        return markdown(results)


def run_text(run: TextRun) -> dict:
    """The whole run (``text``'s and ``text-bytes``' module docstrings): the dev documents' numbers, the
    rows fit on them, every row on every test document; returns ``results.json``'s content."""
    settings, out = run.settings, run.out
    out.mkdir(parents=True, exist_ok=True)
    dev = per_domain(load_documents("dev", settings.data), settings.dev_per_domain)
    test = load_documents("test", settings.data)[: settings.limit]
    head, seconds = run.prepare(dev)
    t0 = time.perf_counter()
    dev_f = run.numbers(dev, "dev")
    seconds[run.stages[0]] = time.perf_counter() - t0
    fitted = run.fit(dev_f)
    stderr_log(f"{run.task} fit on dev: " + "; ".join(f"{row} {p.as_dict()}" for row, p in fitted.items()))
    t0 = time.perf_counter()
    test_f = run.numbers(test, "test")
    seconds[run.stages[1]] = time.perf_counter() - t0
    records = [{"id": d.id, "domain": d.domain, "bytes": d.nbytes, **run.record(f),
                "bits": {row: round(_bits(lp), 4) for row, lp in run.logprobs(f, fitted).items()}}
               for d, f in zip(test, test_f)]
    results = {"task": run.task, "members": run.names, **head,
               "fitted": {row: p.as_dict() for row, p in fitted.items()},
               "dev_documents": len(dev), "test_documents": len(test), "seconds": _add_seconds(out, seconds)}
    return publish(out, run.task, records, run.finish(results, records), run.render)


class TokenRun(TextRun):
    """``--tasks text``: the token-level rows on the primary member's tokens (the module docstring)."""

    task, predicts, stages = "text", "tokens", ("dev_features", "test_features")
    primary: int  # the primary member's index: chosen by ``prepare``, which ``run_text`` calls first

    def prepare(self, dev: Sequence[Document]) -> tuple[dict, dict[str, float]]:
        t0 = time.perf_counter()
        dev_bpb: dict = {}
        if self.settings.primary is not None:
            if self.settings.primary not in self.names:
                raise TokenfuseError(f"--primary: {self.settings.primary!r} is not a member "
                                     f"(members: {', '.join(self.names)})")
            self.primary = self.names.index(self.settings.primary)
        else:
            self.primary, dev_bpb = _choose_primary(self.members, per_domain(dev, self.settings.choose_per_domain),
                                                    self.out, self.settings.progress)
        return ({"primary": self.names[self.primary], "dev_bpb": dev_bpb},
                {"choose_primary": time.perf_counter() - t0})

    def numbers(self, docs: Sequence[Document], split: str) -> list[DocFeatures]:
        members, primary, vocabs = self.members, self.primary, {}
        return cached(self.out / "features" / f"{split}-{members[primary].name}", docs,
                      lambda d: doc_features(d.text, members, primary, vocabs=vocabs), DocFeatures.to_npz,
                      DocFeatures.from_npz, self.settings.progress,
                      f"text {split}: {len(members)} members' numbers, primary {members[primary].name},", split)

    def fit(self, dev: Sequence[DocFeatures]) -> dict[str, Fitted]:
        return text_rows.fit(dev, len(self.members))

    def rows(self) -> list[str]:
        return row_names(self.members)

    def logprobs(self, f: DocFeatures, fitted: dict[str, Fitted]) -> dict[str, float]:
        return {row: text_rows.row_logprob(row, f, self.names, fitted.get(row, Fitted())) for row in self.rows()}

    def record(self, f: DocFeatures) -> dict:
        return {"pieces": len(f.p_true)}


def _choose_primary(members: Sequence[Rows], dev: Sequence[Document], out: Path, progress: bool) -> tuple[int, dict]:
    """Each member alone on the dev documents (kept in ``out/dev-single.json``); the fewest bits per byte wins."""
    path = out / "dev-single.json"
    done: dict[str, dict[str, float]] = json.loads(path.read_text()) if path.is_file() else {}
    nbytes = sum(d.nbytes for d in dev)
    stderr_log(f"text dev: each of {len(members)} members alone on {len(dev)} dev documents ({nbytes:,} bytes), "
         "to choose the primary")
    for m in members:
        mine = done.setdefault(m.name, {})
        todo = [d for d in dev if d.id not in mine]
        with progress_bar(total=len(dev), initial=len(dev) - len(todo), desc=f"dev {m.name}", unit="doc",
                          enabled=progress) as bar:
            for d in todo:
                mine[d.id] = _bits(float(np.sum(single_logprobs(m, d.text))))
                path.write_text(json.dumps(done))
                bar.update(1)
    bpb = {m.name: sum(done[m.name][d.id] for d in dev) / nbytes for m in members}
    best = min(range(len(members)), key=lambda i: bpb[members[i].name])
    stderr_log("text dev bits per byte: " + ", ".join(f"{k} {v:.4f}" for k, v in bpb.items())
         + f" -> primary {members[best].name}")
    return best, bpb


def score_texts(members: Sequence[Rows], texts: Sequence[str], primary: int, fitted: dict, *,
                pieces: bool = False) -> list[dict]:
    """``tokenfuse score``: every row's bits per byte of each text (``--json``'s shape per text)."""
    out = []
    for text in texts:
        f = doc_features(text, members, primary)
        nbytes = len(text.encode("utf-8"))
        rows = {}
        true, cand = text_rows.components(f, len(members)) if pieces else (None, None)
        for row in row_names(members):
            p = fitted.get(row, Fitted())
            lp = text_rows.row_logprob(row, f, [m.name for m in members], p)
            entry = score_entry(lp, nbytes)
            if pieces and row in text_rows.TOKEN_ROWS:
                entry["piece_logprobs"] = [round(float(x), 5) for x in text_rows.token_logprobs(row, true, cand, f, p)]
            rows[row] = entry
        item = {"bytes": nbytes, "rows": rows}
        if pieces:
            item["piece_bytes"] = f.piece_bytes
        out.append(item)
    return out
