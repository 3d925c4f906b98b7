"""Tokenizer agreement between members (GaC Fig. 2).

For each pair of members: the share of the most common English words that both tokenise
identically. Two tokenizations are identical when their pieces, as exact byte strings, are the same
sequence (``["hel", "lo"]`` against ``["hello"]`` is not). Words come from ``wordfreq``
(``top_n_list("en", n)``; GaC used the Oxford 5000 list, which is not freely available). Each word
is tokenised as mid-stream text (no BOS, no dummy prefix: ``ByteCodec.encode_text``) twice: as is
(``"hello"``, a word at the start of a line) and with a leading space (``" hello"``, a word inside a
sentence — the form that matters while generating).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path


def pieces(codec, text: str) -> tuple[bytes, ...]:
    """The byte strings of ``text``'s tokens under ``codec``."""
    return tuple(codec.token_bytes[i] or b"" for i in codec.encode_text(text))


def agreement_matrix(codecs: Mapping[str, object], words: Sequence[str], *, leading_space: bool) -> list[list[float]]:
    """``m[a][b]``: share of ``words`` that members ``a`` and ``b`` tokenise into the same byte pieces."""
    names = list(codecs)
    prefix = " " if leading_space else ""
    split = {n: [pieces(codecs[n], prefix + w) for w in words] for n in names}
    n_words = max(len(words), 1)
    return [[sum(x == y for x, y in zip(split[a], split[b])) / n_words for b in names] for a in names]


def common_words(n: int) -> list[str]:
    try:
        from wordfreq import top_n_list
    except ImportError:
        from tokenfuse.errors import TokenfuseError

        raise TokenfuseError("analyze tokenizers needs wordfreq: pip install 'tokenfuse[eval]'") from None
    return top_n_list("en", n)


def load_codecs(cfg) -> dict[str, object]:
    """Each member's ``ByteCodec`` from its tokenizer alone (no model weights are loaded)."""
    from tokenfuse.members.codec import ByteCodec
    from tokenfuse.bundled import BUNDLED
    from tokenfuse.members.gguf_tokenizer import ensure_tokenizer

    codecs = {}
    for m in cfg.members:
        source = m.resolved_source
        if source in BUNDLED:
            from tokenfuse.members.fasttok import FastTokenizer

            tok = FastTokenizer(ensure_tokenizer(source, progress=False))
        else:
            from transformers import AutoTokenizer

            from tokenfuse.logs import route_transformers_logs

            route_transformers_logs()
            tok = AutoTokenizer.from_pretrained(source, trust_remote_code=m.trust_remote_code)
        codecs[m.name] = ByteCodec(tok)
    return codecs


def table(names: Sequence[str], with_space: list[list[float]], without: list[list[float]], n_words: int) -> str:
    lines = [f"Share of the {n_words} most common English words (wordfreq) tokenised into identical byte pieces",
             "(upper triangle: with a leading space, `\" word\"`; lower triangle: without, `\"word\"`):", "",
             "| | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for i, a in enumerate(names):
        cells = []
        for j in range(len(names)):
            cells.append("—" if i == j else f"{100 * (with_space if j > i else without)[i][j]:.1f} %")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def heatmap(names: Sequence[str], with_space, without, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.2 * len(names), 1.5 + 1.6 * len(names)))
    for ax, m, title in ((axes[0], with_space, 'with leading space (" word")'), (axes[1], without, 'no space ("word")')):
        ax.imshow([[100 * v for v in row] for row in m], vmin=0, vmax=100, cmap="viridis")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7)
        for i in range(len(names)):
            for j in range(len(names)):
                ax.text(j, i, f"{100 * m[i][j]:.0f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle("identical tokenisation of common English words (%)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_tokenizers(cfg, *, n_words: int = 5000, out: str | Path = "analyze-out") -> str:
    """Compute both matrices for ``cfg``'s members; write tokenizers.{md,json,png} to ``out``; return the table."""
    words = common_words(n_words)
    codecs = load_codecs(cfg)
    names = list(codecs)
    ws = agreement_matrix(codecs, words, leading_space=True)
    wo = agreement_matrix(codecs, words, leading_space=False)
    text = table(names, ws, wo, len(words))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizers.md").write_text(text, encoding="utf-8")
    (out / "tokenizers.json").write_text(json.dumps({"members": names, "words": len(words), "with_space": ws,
                                                     "without_space": wo}, indent=1) + "\n", encoding="utf-8")
    heatmap(names, ws, wo, out / "tokenizers.png")
    return text
