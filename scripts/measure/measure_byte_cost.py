#!/usr/bin/env python
"""What a member's byte model costs against its own scoring of the same bytes, and what its pruning
loses against the top rule: the figures of docs/benchmarks.md, "Byte models: cost".

Per bundled member on llama.cpp (loaded one at a time), on DEV text only: ``--slices`` (the first 1,500
bytes of the first dev document of each domain, the slices of the earlier byte-view benchmarks) or the
whole dev split of the ``text-bytes`` run (its first ``DEV_PER_DOMAIN`` dev documents of each domain).
For each text: the member's own scoring of its tokens (``single_logprobs``: one run, every position's
row) and its byte model (``score_bytes`` through the member's reader, its own tokens read ahead) under
the pruning given by the flags; wall seconds of one run each after one warm-up of the own scoring.
Bits against the top rule are read from the committed ``text-bytes`` run's dev views (its byte models
under the top rule, keep 1e-2, width 1; a byte's probability depends only on the bytes before it, so a
slice's are the first bytes of its document's).

    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure/measure_byte_cost.py --slices \
        --rule defer --keep 0.002 [--out docs/benchmarks/cpu-byteview-cost-slices.json]
    TOKENFUSE_DATA=../shared/benchmarks .venv/bin/python scripts/measure/measure_byte_cost.py --split \
        --run docs/results/text-bytes-defer --out docs/benchmarks/cpu-byteview-cost.json

``--calls`` (not with ``--run``): also where the byte model's time goes, from its tree reader's counters
(``TreeReader.stats``: decode calls feeding the trunk or the detour, and branch calls; ids fed, rows,
seconds in llama.cpp's decode), the rest of its seconds being host work (the rows' log-softmax, the
byte model's own work), and the lists it read against the rows the model used.

Run it alone on the machine. Prints one JSON object: per member ``rows_per_byte``, ``rows_per_own_token``,
``view_vs_own`` (seconds of the byte model ÷ seconds of the own scoring), ``bits_vs_top`` (relative
difference in bits per byte against the top rule) and the raw counts; with ``--run``, also ``dev_gain``:
each byte row's gain over the best member on those dev documents (the rows fit on them) under the run's
pruning and under the first run's top rule.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import subprocess
import time
from pathlib import Path

import numpy as np

from tokenfuse.alignment.bytemodel import Pruning
from tokenfuse.alignment.bytetree import TokenBytes
from tokenfuse.alignment.byteview import score_bytes
from tokenfuse.bundled import BUNDLED
from tokenfuse.config import MemberConfig
from tokenfuse.engine.text_features import Rows, primary_tokens
from tokenfuse.eval.score_cli import add_pruning_arguments, pruning_of
from tokenfuse.eval.text import DEV_PER_DOMAIN, doc_key, per_domain, single_logprobs
from tokenfuse.load import load_member
from tokenfuse.members.llamacpp_tree import TreeReader
from tokenfuse.tasks.text import load_documents

RUN = Path(__file__).resolve().parents[2] / "docs" / "results" / "text-bytes"
SLICE = 1500


def cut(text: str, n: int) -> str:
    """The first ``n`` bytes of ``text``, backed off to a whole UTF-8 character."""
    return text.encode("utf-8")[:n].decode("utf-8", "ignore")


@contextlib.contextmanager
def counted(member, stats: dict):
    """The member's llama.cpp tree reader as a ``take``, its counters added to ``stats`` when it closes
    (``stats["lists_read"]``: the lists of rows it was asked for)."""
    reader = TreeReader(member)

    def take(x, ids):
        stats["lists_read"] = stats.get("lists_read", 0) + len(x)
        return reader.take(x, ids)

    try:
        yield take
    finally:
        reader.close()
    for kind, c in reader.stats.items():
        acc = stats.setdefault(kind, {"calls": 0, "ids": 0, "rows": 0, "seconds": 0.0})
        for k, v in dataclasses.asdict(c).items():
            acc[k] += v


def measure(source: str, index: int, docs: list, n_bytes: int | None, pruning: Pruning, run: Path | None = None,
            calls: bool = False) -> dict:
    m = load_member(MemberConfig(name=source, source=source, backend="llamacpp"), progress=False)
    try:
        rows = Rows.from_member(m)
        tokens = TokenBytes(m.codec.token_bytes)
        texts = [cut(d.text, n_bytes) if n_bytes else d.text for d in docs]
        single_logprobs(rows, texts[0])  # warm-up
        own_s = own_lp = 0.0
        own_tokens = 0
        for t in texts:
            t0 = time.perf_counter()
            own_lp += float(np.sum(single_logprobs(rows, t)))
            own_s += time.perf_counter() - t0
            own_tokens += len(primary_tokens(m.codec, t))
        view_s = view_lp = top_lp = 0.0
        read = deferrals = reseeds = 0
        nbytes = 0
        stats: dict[str, dict] = {}
        for d, t in zip(docs, texts):
            data = t.encode("utf-8")
            if run is not None:  # the views a text-bytes run made of the whole documents (its seconds, alone)
                got = np.load(run / "bytes" / "dev" / f"{doc_key(d)}.npz")
                view_s += float(got["seconds"][index])
                view_lp += float(got[f"q{index}"].sum())
                read += int(got["rows"][index])
                nbytes += len(data)
                top_lp += float(np.load(RUN / "bytes" / "dev" / f"{doc_key(d)}.npz")[f"q{index}"].sum())
                continue
            t0 = time.perf_counter()
            with (counted(m, stats) if calls else rows.reader()) as take:
                s = score_bytes(data, tokens, rows.start, take, chain=primary_tokens(m.codec, t), pruning=pruning)
            view_s += time.perf_counter() - t0
            view_lp += float(s.logprobs.sum())
            read += s.rows
            deferrals += s.deferrals
            reseeds += s.reseeds
            nbytes += len(data)
            top_lp += float(np.load(RUN / "bytes" / "dev" / f"{doc_key(d)}.npz")[f"q{index}"][: len(data)].sum())
        bpb = -view_lp / math.log(2) / nbytes
        top_bpb = -top_lp / math.log(2) / nbytes
        return {"rows_per_byte": round(read / nbytes, 4), "rows_per_own_token": round(read / own_tokens, 4),
                "view_vs_own": round(view_s / own_s, 3), "bits_vs_top": round(bpb / top_bpb - 1, 5),
                "bytes": nbytes, "own_tokens": own_tokens, "rows": read, "deferrals": deferrals, "reseeds": reseeds,
                "view_seconds": round(view_s, 2), "own_seconds": round(own_s, 2), "bpb": round(bpb, 5),
                "top_bpb": round(top_bpb, 5), "own_bpb": round(-own_lp / math.log(2) / nbytes, 5),
                **({"calls": {"lists_read": stats.pop("lists_read", 0), **{k: {**v, "seconds": round(v["seconds"], 2)} for k, v in stats.items()},
                              "host_seconds": round(view_s - sum(v["seconds"] for v in stats.values()), 2)}}
                   if calls else {})}
    finally:
        m.unload()


def dev_gains(folder: Path, docs: list, n: int) -> dict:
    """Each byte row's gain over the best member alone (its own tokens) on the dev documents' views in
    ``folder``, the rows fit on those same documents (in-sample: the dev split is the fit's): ``1 −
    bits(row) / bits(best)``, pooled."""
    from tokenfuse.engine import text_rows

    views = [dict(np.load(folder / "bytes" / "dev" / f"{doc_key(d)}.npz")) for d in docs]
    q = [np.exp(np.stack([f[f"q{i}"] for i in range(n)], axis=1)) for f in views]
    fitted = text_rows.fit_bytes(q)
    best = min(-sum(float(f[f"single{i}"].sum()) for f in views) for i in range(n))
    return {row: round(1 - -sum(float(text_rows.byte_logprobs(row, x, fitted[row]).sum()) for x in q) / best, 5)
            for row in text_rows.BYTE_ROWS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--slices", action="store_true", help=f"the first {SLICE:,} bytes of the first dev document of each domain")
    where.add_argument("--split", action="store_true", help="the text-bytes run's whole dev split")
    ap.add_argument("--members", help="comma-separated bundled members (default: the text-bytes run's)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--run", help="with --split: take the byte models' bits, rows and seconds from this text-bytes "
                                  "run's dev views (made alone on the machine) and time only the own scoring")
    ap.add_argument("--calls", action="store_true", help="also where the byte model's time goes (the tree reader's "
                                                        "decode calls, host work, lists read); not with --run")
    add_pruning_arguments(ap)
    args = ap.parse_args()
    if args.calls and args.run:
        ap.error("--calls times the byte models here: not with --run")
    run = json.loads((RUN / "results.json").read_text())
    if args.run:
        from tokenfuse.eval.text_bytes import run_pruning

        pruning = run_pruning(json.loads((Path(args.run) / "results.json").read_text())) if (
            Path(args.run) / "results.json").is_file() else pruning_of(args)
    else:
        pruning = pruning_of(args)
    names = args.members.split(",") if args.members else run["members"]
    dev = per_domain(load_documents("dev"), DEV_PER_DOMAIN)
    docs = per_domain(dev, 1) if args.slices else dev
    if args.run:  # the documents the run has views of (a run still under way: those done)
        docs = [d for d in docs if (Path(args.run) / "bytes" / "dev" / f"{doc_key(d)}.npz").is_file()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"texts": "dev slices (first 1,500 bytes of the first dev document of each domain)" if args.slices
           else f"the text-bytes run's dev split ({len(docs)} of {len(dev)} documents)",
           "pruning": dataclasses.asdict(pruning), "views": f"from {args.run}" if args.run else "computed here",
           "commit": commit}
    for name in names:
        assert name in BUNDLED, name
        out[name] = measure(name, run["members"].index(name), docs, SLICE if args.slices else None, pruning,
                            Path(args.run) if args.run else None, args.calls)
        print(json.dumps({name: out[name]}), flush=True)
    if args.run:  # the byte rows' dev gains under this run's pruning and under the top rule's first run
        n = len(run["members"])
        out["dev_gain"] = {"run": dev_gains(Path(args.run), docs, n), "top": dev_gains(RUN, docs, n)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
