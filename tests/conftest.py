"""Shared fixtures: the real tokenizers of the bundled models and tiny random-weight models on them.

Tokenizers are converted from the bundled GGUF files once (seconds, tokenizer only) into the
tokenfuse cache. Tiny models (2 layers, hidden 32) are built from a seed on top of each real
tokenizer, so most tests run the real alignment and re-sync logic in milliseconds per step.

``TOKENFUSE_TEST_DEVICE=cuda`` puts the tiny models on that device (default ``cpu``): the same
exact-output tests then run the members' forwards on a GPU (see docs/benchmarks.md, "On a GPU").

The files run in worker processes (pytest-xdist, ``-n auto`` in pyproject.toml): one per core, at most
``MAX_WORKERS`` and as many as the memory holds, each worker on its own cores.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_WORKERS = 4
GIB_PER_WORKER = 6  # a worker may hold the real members on both backends (about 4.5 GB) and a test's own


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _memory_gib() -> float:
    """The machine's memory, or the cgroup's limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(Path(limit).read_text()))
        except (OSError, ValueError):  # absent, or "max"
            pass
    return total / 2**30


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most ``MAX_WORKERS`` and one per ``GIB_PER_WORKER`` of memory."""
    return max(1, min(MAX_WORKERS, len(_cores()), int(_memory_gib() // GIB_PER_WORKER)))


def _pin_worker() -> None:
    """A worker runs on its share of the cores: torch and llama.cpp size their thread pools from the
    affinity, so the workers' threads do not spin against each other. Before torch is imported."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = _cores()
    if worker and count > 1 and count <= len(cores) and hasattr(os, "sched_setaffinity"):
        share = len(cores) // count
        i = int(worker.removeprefix("gw"))
        try:
            os.sched_setaffinity(0, cores[i * share:(i + 1) * share])
        except OSError:  # not allowed here: the workers share the cores
            pass


_pin_worker()

import pytest  # noqa: E402
import torch  # noqa: E402

from tokenfuse.bundled import BUNDLED, DEFAULT_ENSEMBLE  # noqa: E402
from tokenfuse.members.gguf_tokenizer import ensure_tokenizer  # noqa: E402
from tokenfuse.members.transformers import TransformersMember  # noqa: E402
from tokenfuse.paths import cache_dir  # noqa: E402

torch.set_num_threads(len(_cores()))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEST_DEVICE = os.environ.get("TOKENFUSE_TEST_DEVICE", "cpu")
SHORT = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m", "qwen": "qwen2.5-coder-0.5b-instruct"}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and threads spin badly on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def align_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("alignment")


@pytest.fixture(scope="session")
def tokenizer_dirs() -> dict[str, Path]:
    """Directories holding each bundled model's tokenizer.json, keyed by short name."""
    root = cache_dir()
    missing = [n for n in DEFAULT_ENSEMBLE if not (BUNDLED[n].installed() or BUNDLED[n].is_cached(root, model=False))]
    if missing:
        pytest.fail("bundled models not installed: " + "; ".join(BUNDLED[n].pip_command for n in missing))
    return {short: ensure_tokenizer(full, progress=False) for short, full in SHORT.items()}


@pytest.fixture(scope="session")
def tokenizers(tokenizer_dirs):
    from transformers import AutoTokenizer

    return {k: AutoTokenizer.from_pretrained(v) for k, v in tokenizer_dirs.items()}


def tiny_model(vocab_size: int, *, seed: int, layers: int = 2, hidden: int = 32, eos: int | None = None):
    """A random-weight Llama-architecture causal LM with ``vocab_size`` output rows, on ``TEST_DEVICE``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, initializer_range=0.5, tie_word_embeddings=False,
                      eos_token_id=eos)
    return LlamaForCausalLM(cfg).eval().to(TEST_DEVICE)


@pytest.fixture(scope="session")
def make_tiny(tokenizers, align_cache):
    """Factory: ``make_tiny("gemma3", seed=1, name=None, weight=1.0, pad=0)`` -> a tiny member."""
    built: dict = {}

    def make(family: str, *, seed: int = 0, name: str | None = None, weight: float = 1.0, pad: int = 0):
        tok = tokenizers[family]
        key = (family, seed, pad)
        if key not in built:
            built[key] = tiny_model(len(tok) + pad, seed=seed)
        return TransformersMember(name or f"{family}-{seed}", built[key], tok, weight=weight,
                                  align_cache=align_cache)

    return make


@pytest.fixture(scope="session")
def real_members(align_cache):
    """The three real bundled models (converted on first use), keyed by short name."""
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    return {short: load_member(MemberConfig(name=short, source=full, backend="transformers"), progress=False)
            for short, full in SHORT.items()}


@pytest.fixture(scope="session")
def llamacpp_members():
    """The three bundled models on the llama.cpp backend (quantised, as shipped)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh installs it)")
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    return {short: load_member(MemberConfig(name=short, source=full, backend="llamacpp"), progress=False)
            for short, full in SHORT.items()}


@pytest.fixture(scope="module")
def members(make_tiny, one_thread):
    """Three tiny members named A, B, C (SmolLM2, Qwen and Gemma-3 tokenizers): the server tests' ensemble."""
    return [make_tiny("smollm2", seed=0, name="A"), make_tiny("qwen", seed=1, name="B"),
            make_tiny("gemma3", seed=2, name="C")]


@pytest.fixture(scope="module")
def ens(members, align_cache):
    from tokenfuse.engine import Ensemble

    return Ensemble(members, align_cache=align_cache)


TEXT_DOCS = {"code": "x = 1\n", "en": "The cat sat.", "zh": "你好，世界"}


@pytest.fixture
def text_data(tmp_path):
    """A data folder with ``text/{dev,test}.jsonl``: one document per domain of ``TEXT_DOCS``, its text
    followed by the split's name (ids ``<split>-<domain>``)."""
    import json

    (tmp_path / "data" / "text").mkdir(parents=True)
    for split in ("dev", "test"):
        with open(tmp_path / "data" / "text" / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for dom, t in TEXT_DOCS.items():
                f.write(json.dumps({"id": f"{split}-{dom}", "domain": dom, "source": "s", "text": t + split}) + "\n")
    return tmp_path / "data"


@pytest.fixture
def byte_fit(tmp_path):
    """A writer of text-bytes fit files: ``byte_fit(names, weights=None, seed=0)`` writes ``fit.json`` for
    members ``names`` (``byte-mix`` at ``weights``, by default 0.9 on the first and the rest shared;
    ``byte-gate`` and ``byte-online`` with seeded gate numbers large enough to move the weights) and
    returns its path."""
    import json

    import numpy as np

    from tokenfuse.combiners.mixers import RATES

    def write(names, weights=None, seed: int = 0) -> str:
        m = len(names)
        gate = np.random.default_rng(seed).normal(0, 0.5, size=m + m * m * len(RATES)).tolist()
        mix = list(weights) if weights is not None else [0.9] + [0.1 / (m - 1)] * (m - 1)
        path = tmp_path / "fit.json"
        path.write_text(json.dumps({"task": "text-bytes", "members": list(names),
                                    "fitted": {"byte-gate": {"gate": gate}, "byte-mix": {"weights": mix},
                                               "byte-online": {"gate": gate, "rate": 0.3}}}))
        return str(path)

    return write
