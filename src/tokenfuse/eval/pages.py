"""The results pages' tables, regenerated from the committed ``results.json`` files.

    python -m tokenfuse.eval.pages            # rewrite docs/results/*/results.md and the tables in the pages
    python -m tokenfuse.eval.pages --check    # change nothing; exit 1 naming every table that differs

Each ``docs/results/<run>/results.md`` is ``report.markdown_table`` of the ``results.json`` beside it
(what ``tokenfuse eval`` writes), and a page (``README.md``, ``docs/*.md``) holds cuts of those
tables between two marker lines, the prose around them left alone::

    <!-- table: large/results.md#main,gain cols=triviaqa rows=gac,unite -->
    ...generated...
    <!-- end table -->

* ``large/results.md`` — the run, under ``docs/results/``;
* ``#main,gain`` — sections of that results.md, by name: ``main`` (accuracy per task, Avg., cost),
  ``wall`` (wall time per task), ``ci`` (bootstrap intervals), ``raw`` (unnormalised likelihood accuracy), ``gain`` (paired gain
  over the best member), ``proper`` (the likelihood tasks' NLL and Brier score per row), ``proper_gain``
  (their paired difference from the best member), ``answers`` (the answer rows' samples and cost), ``mux`` (``mux`` against the
  best ``sc`` row), ``auto`` (``auto``'s choice per task); a ``text`` or ``text-bytes`` run's one table is its ``main``. Two or more are joined row by row
  on their first column; a later section's columns are headed ``<section>: <column>``;
* ``cols=a,b`` (optional) — keep these columns: a column is kept when its header is a name or
  starts with a name and a space or ``(`` (``Avg.`` keeps ``Avg.`` and ``Avg. vs ...``);
* ``rows=x,y`` (optional) — keep the rows whose first cell is one of these; a row left with no
  value in the kept columns (``seq-avg`` on a generate-form task) is left out.

So no number in a table of the docs can drift from its data: CI runs ``--check``
(``tests/test_docs.py``). Rendering is ``report.markdown_table``'s alone; this module only cuts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tokenfuse.eval.report import markdown_table
from tokenfuse.eval.text_runs import TEXT_RUNS

# A section of report.markdown_table's output is named by the line just above its table.
_CAPTIONS = {"Wall time per task": "wall", "Bootstrap 95 %": "ci", "Likelihood form, unnormalised": "raw",
             "Gain over the best single member": "gain", "Proper scores against": "proper_gain",
             "Proper scores (": "proper", "Answer-level rows": "answers",
             "`mux` against the best `sc`": "mux", "`auto`'s choice": "auto"}
_BLOCK = re.compile(r"^<!-- table: (?P<run>[\w.-]+)/results\.md#(?P<sections>[\w,]+)(?P<opts>[^>]*?) -->\n"
                    r"(?P<body>.*?)^<!-- end table -->$", re.M | re.S)
_MISSING = "–"


def render_run(run_dir: Path) -> str:
    """The run's results.md, rendered from its results.json (a ``text`` or ``text-bytes`` run's by its
    ``TextRun.render``)."""
    data = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    run = TEXT_RUNS.get(data.get("task"))
    render = run.render if run is not None else markdown_table
    return render(data)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def sections(markdown: str) -> dict[str, list[list[str]]]:
    """The tables of a rendered results.md by section name, each a list of rows (header first, no rule)."""
    out: dict[str, list[list[str]]] = {}
    caption, table = None, []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            if not out:
                name = "main"
            else:
                name = next((v for k, v in _CAPTIONS.items() if (caption or "").startswith(k)), None)
                if name is None:
                    raise ValueError(f"a table of results.md under an unknown caption: {caption!r}")
            out[name] = [_cells(row) for i, row in enumerate(table) if i != 1]
            table = []
        if line.strip():
            caption = line
    return out


def _wanted(header: str, names: list[str]) -> bool:
    return any(header == n or header.startswith((n + " ", n + "(")) for n in names)


def cut(tables: dict[str, list[list[str]]], names: list[str], cols: list[str] | None,
        rows: list[str] | None) -> str:
    """Sections ``names`` joined on their first column, cut to ``cols`` and ``rows``, as a markdown table."""
    for n in names:
        if n not in tables:
            raise ValueError(f"no section {n!r} in this results.md (it has {', '.join(tables)})")
    head = [tables[names[0]][0][0]]
    keys: list[str] = []
    by_key: dict[str, list[str]] = {}
    for k, n in enumerate(names):
        header, *body = tables[n]
        keep = [i for i, h in enumerate(header) if i > 0 and (cols is None or _wanted(h, cols))]
        head += [header[i] if k == 0 else f"{n}: {header[i]}" for i in keep]
        width = len(head) - 1 - len(keep)
        for row in body:
            if rows is not None and row[0] not in rows:
                continue
            if row[0] not in by_key:
                keys.append(row[0])
                by_key[row[0]] = [_MISSING] * width
            by_key[row[0]] += [row[i] for i in keep]
        for key in keys:
            by_key[key] += [_MISSING] * (len(head) - 1 - len(by_key[key]))
    keys = [key for key in keys if any(c not in (_MISSING, "—") for c in by_key[key])]  # rows with no value: out
    if len(head) == 1 or not keys:
        raise ValueError(f"cols={cols} rows={rows} leave nothing of {','.join(names)}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([key, *by_key[key]]) + " |" for key in keys]
    return "\n".join(lines) + "\n"


def _options(text: str) -> dict[str, list[str]]:
    opts = {}
    for part in text.split():
        key, sep, value = part.partition("=")
        if not sep or key not in ("cols", "rows"):
            raise ValueError(f"unknown marker option {part!r} (cols=..., rows=...)")
        opts[key] = value.split(",")
    return opts


def regenerate(page: str, results_dir: Path, rendered: dict[str, str]) -> str:
    """``page`` with every marked table made again from ``results_dir``; ``rendered`` caches each run's results.md."""
    def block(m: re.Match) -> str:
        run = m["run"]
        if run not in rendered:
            rendered[run] = render_run(results_dir / run)
        opts = _options(m["opts"])
        table = cut(sections(rendered[run]), m["sections"].split(","), opts.get("cols"), opts.get("rows"))
        return m.group(0)[:m.start("body") - m.start()] + "\n" + table + "\n<!-- end table -->"  # blank lines: markdown

    return _BLOCK.sub(block, page)


def pages(root: Path) -> list[Path]:
    """The pages that may hold tables: the README and every markdown page directly under docs/."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def update(root: Path, *, check: bool = False) -> list[str]:
    """Regenerate (or with ``check`` only compare) every results.md and page; the paths that differ(ed)."""
    results_dir = root / "docs" / "results"
    rendered: dict[str, str] = {}
    stale = []
    for run_dir in sorted(p.parent for p in results_dir.glob("*/results.json")):
        rendered[run_dir.name] = text = render_run(run_dir)
        target = run_dir / "results.md"
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            stale.append(str(target.relative_to(root)))
            if not check:
                target.write_text(text, encoding="utf-8")
    for page in pages(root):
        old = page.read_text(encoding="utf-8")
        new = regenerate(old, results_dir, rendered)
        if new != old:
            stale.append(str(page.relative_to(root)))
            if not check:
                page.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenfuse.eval.pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("."), help="the repository (default: .)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its data")
    args = p.parse_args(argv)
    try:
        stale = update(args.root, check=args.check)
    except (OSError, ValueError, KeyError) as err:
        print(f"tokenfuse.eval.pages: {err}", file=sys.stderr)
        return 2
    for path in stale:
        print(f"{'differs from its results.json' if args.check else 'rewritten'}: {path}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
