"""The docs against their data and each other: every results table in README.md and docs/*.md is
what the committed results.json gives (``python -m tokenfuse.eval.pages --check``), and every
relative link between the pages points to a file (and heading) that exists."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tokenfuse.eval import pages

ROOT = Path(__file__).resolve().parent.parent


def test_every_results_table_matches_its_results_json():
    stale = pages.update(ROOT, check=True)
    assert stale == [], ("these differ from what their results.json gives; run "
                         f"`python -m tokenfuse.eval.pages` and commit: {stale}")
    blocks = sum(p.read_text(encoding="utf-8").count("<!-- table: ") for p in pages.pages(ROOT))
    assert blocks >= 10  # the results pages and the README hold generated tables, so the check is not empty


def _copy_run(tmp_path: Path, run: str = "pair-boolq") -> Path:
    (tmp_path / "docs" / "results" / run).mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "results" / run / "results.json", tmp_path / "docs" / "results" / run)
    return tmp_path / "docs" / "results" / run


def test_pages_fill_a_marked_table_and_check_catches_a_changed_number(tmp_path):
    run = _copy_run(tmp_path)
    page = tmp_path / "docs" / "page.md"
    page.write_text("Prose.\n\n<!-- table: pair-boolq/results.md#main,gain cols=boolq rows=gac,unite -->\n"
                    "stale\n<!-- end table -->\n\nMore prose.\n", encoding="utf-8")
    assert pages.main(["--root", str(tmp_path), "--check"]) == 1  # results.md missing, the table stale
    assert sorted(pages.update(tmp_path)) == ["docs/page.md", "docs/results/pair-boolq/results.md"]
    assert pages.update(tmp_path, check=True) == []
    text = page.read_text(encoding="utf-8")
    assert text.startswith("Prose.\n\n<!-- table: ") and text.endswith("<!-- end table -->\n\nMore prose.\n")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows == ["| method | boolq (500) | gain: boolq |",
                    "| gac | 60.6 | **-0.2** [-1.8, +1.4] |",
                    "| unite | 61.0 | +0.2 [-1.4, +1.6] |"]

    page.write_text(text.replace("| 61.0 |", "| 61.2 |"), encoding="utf-8")  # a number edited by hand
    assert pages.update(tmp_path, check=True) == ["docs/page.md"]
    results = json.loads((run / "results.json").read_text(encoding="utf-8"))
    results["tasks"]["boolq"]["unite"]["acc"] = 0.612  # or the data changed under the table
    (run / "results.json").write_text(json.dumps(results), encoding="utf-8")
    assert pages.update(tmp_path, check=True) == ["docs/results/pair-boolq/results.md"]
    assert pages.main(["--root", str(tmp_path), "--check"]) == 1


def test_sections_of_a_rendered_results_md():
    tables = pages.sections(pages.render_run(ROOT / "docs" / "results" / "large"))
    assert list(tables) == ["main", "wall", "ci", "raw", "gain", "auto"]
    auto = pages.cut(tables, ["auto"], ["chosen"], ["bbh"])
    assert auto.splitlines()[2] == "| bbh | single:qwen2.5-coder-0.5b-instruct |"
    # seq-avg has no generate-form cell: a row left without values is dropped
    assert "seq-avg" not in pages.cut(tables, ["main"], ["gsm8k"], None)


# ---------------------------------------------------------------------------------------- links

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's id of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def broken_links(root: Path) -> list[str]:
    """Every relative link in README.md and docs/*.md whose file (or heading) does not exist."""
    bad = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code is not a link
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    assert broken_links(ROOT) == []
    assert (ROOT / "docs" / "playground.png").is_file()


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "usage.md").write_text("# Usage\n\n## Python API\n\nSee [the README](../README.md).\n",
                                                encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "# x\n\n[ok](docs/usage.md) [ok](docs/usage.md#python-api) [web](https://example.com/a.md)\n"
        "`[code](docs/nope.md)`\n\n```\n[in a block](docs/nope.md)\n```\n"
        "[moved](docs/methods.md) [gone](docs/usage.md#backends)\n", encoding="utf-8")
    assert broken_links(tmp_path) == ["README.md: docs/methods.md (no such file)",
                                      "README.md: docs/usage.md#backends (no such heading)"]
