"""Member backend: a Hugging Face transformers causal LM (CPU, or CUDA when present)."""

from __future__ import annotations

import hashlib
import inspect
import time
from pathlib import Path
from typing import Any

import torch

from tokenfuse.bundled import transformers_build
from tokenfuse.errors import ModelLoadError
from tokenfuse.members.base import LocalMember, SeqState, picked
from tokenfuse.members.codec import load_or_build_codec
from tokenfuse.members.embeddings import EmbeddingRows

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersMember(LocalMember):
    """A transformers ``AutoModelForCausalLM``.

    ``batched`` (the default): every sequence's keys and values in one ``RowStore``
    (``tokenfuse.members.row_cache``) and all the rows of a call fed in one forward, each row with
    its own length and rollback. ``batched=False``: one ``DynamicCache`` per sequence, one forward
    each (the numbers of a sequence then never depend on what else is in the batch; see
    ``row_cache`` for how close the batched numbers are). Models whose attention takes no 4-D mask
    (attention implementations other than ``sdpa`` and ``eager``) run unbatched.

    ``context_length`` is the text config's ``max_position_embeddings`` (``None`` when it has none).
    """

    def __init__(self, name: str, model: Any, tokenizer: Any, *, weight: float = 1.0,
                 content_hash: str | None = None, align_cache: Path | None = None, batched: bool = True) -> None:
        self.name = name
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.weight = float(weight)
        self.device = next(model.parameters()).device
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        self.batched = bool(batched) and attn in ("sdpa", "eager")
        self._store = None  # the RowStore, made at the first batched forward
        # forward's KV-cache argument: ``cache`` in later transformers 5.x (where ``past_key_values`` warns
        # and goes in 5.40), ``past_key_values`` before; a forward taking only ``**kwargs`` gets the old name
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        text_config = model.config.get_text_config()
        n = getattr(text_config, "max_position_embeddings", None)
        self.context_length = n if isinstance(n, int) and n > 0 else None
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        extra = eos if isinstance(eos, list | tuple) else ([eos] if eos is not None else [])
        self.codec = load_or_build_codec(
            tokenizer, vocab_size=text_config.vocab_size, extra_end_ids=extra,
            content_hash=content_hash, cache=align_cache,
        )

    def embedding_rows(self) -> EmbeddingRows:
        """The model's own input-embedding weight (never copied)."""
        return EmbeddingRows(tensor=self.model.get_input_embeddings().weight)

    def release(self, state: SeqState) -> None:
        """Free a finished sequence's cache (its slot of the row store goes back at once)."""
        free = getattr(state.cache, "free", None)
        if free is not None:
            free()
        super().release(state)

    @property
    def scores_together(self) -> bool:
        """Batched: one-forward scoring feeds many requests in one forward (``logprobs_at_many``)."""
        return self.batched

    def cache_bytes(self) -> int:
        """Bytes held by the batched key/value store now (0 unbatched: those caches are the sequences')."""
        return self._store.nbytes() if self._store is not None else 0

    def _unload(self) -> None:
        """Drop the model: its weights are freed once no member holds it (a self-ensemble's copies share it)."""
        self.model = None
        if self._store is not None:
            self._store.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _forward(self, st: SeqState) -> torch.Tensor:
        return self._forward_batch([st])[0]

    def _forward_batch(self, states: list[SeqState]) -> list[torch.Tensor]:
        """Every state's pending ids: batched, one forward for the rows with one id pending and one
        for each group of longer ones (``row_cache.batches``); else one forward per state."""
        return [rows[0] for rows in self._forward_at_many(states, [[st.length] for st in states])]

    def _forward_at_many(self, states: list[SeqState], ends: list[list[int]], *,
                         picks: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """Batched: the states in as few forwards as ``row_cache.batches`` groups them; else one
        forward per state (``_forward_one``). ``picks``: the rows' entries, taken on the host."""
        if not self.batched:
            out = [self._forward_one(st, e) for st, e in zip(states, ends)]
        else:
            from tokenfuse.members.row_cache import batches

            out = [None] * len(states)
            for group in batches(states):
                for r, got in zip(group, self._rows([states[r] for r in group], [ends[r] for r in group])):
                    out[r] = got
        if picks is None:
            return out
        return [[picked(row, pick, k) for k, row in enumerate(rows)] for rows, pick in zip(out, picks)]

    @torch.inference_mode()
    def _rows(self, states: list[SeqState], ends: list[list[int]]) -> list[list[torch.Tensor]]:
        from tokenfuse.members.row_cache import RowStore, forward_rows

        if self._store is None:
            self._store = RowStore(self.device)
        return forward_rows(self.model, self._store, states, ends, cache_arg=self._cache_arg)

    @torch.inference_mode()
    def _forward_one(self, st: SeqState, ends: list[int]) -> list[torch.Tensor]:
        """Unbatched: crop the sequence's own cache to ``n_valid``, feed the rest in one forward, keep
        the logits from the first wanted position on."""
        from transformers import DynamicCache

        if st.cache is None:
            st.cache = DynamicCache()  # full layers (no sliding-window trimming) so crop() can roll back
            st.n_valid = 0
        cached = st.cache.get_seq_length()
        if cached > st.n_valid:
            st.cache.crop(st.n_valid - cached)  # a negative count removes that many positions
        new = st.all_ids()[st.n_valid :]
        ids = torch.tensor([new], dtype=torch.long, device=self.device)
        keep = st.length - ends[0] + 1  # logits of positions ends[0] - 1 .. length - 1
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self._cache_arg: st.cache})
        logits = out.logits[0].float()
        first = st.length - keep
        return [torch.log_softmax(logits[n - 1 - first], dim=-1).cpu() for n in ends]


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA (half the weight reads of float32), float32 elsewhere (CPU kernels
    for bfloat16 are slower, and the tests' exact numbers are float32's); other names as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def load_transformers_member(
    name: str,
    source: str,
    *,
    gguf_file: str | None = None,
    weight: float = 1.0,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    align_cache: Path | None = None,
    tokenizer: Any = None,
    batched: bool = True,
) -> TransformersMember:
    """Load a member from a hub id, a local directory (safetensors) or a GGUF file.

    ``dtype``: ``auto`` is bfloat16 on CUDA and float32 on the CPU (``resolve_dtype``).
    ``tokenizer``: an already loaded tokenizer to use instead of ``AutoTokenizer`` (the bundled
    models pass the fast ``FastTokenizer``). ``batched``: see ``TransformersMember``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(dtype, device)
    path = Path(source).expanduser()
    if gguf_file is None and path.suffix == ".gguf" and path.is_file():
        path, gguf_file = path.parent, path.name
    where = str(path) if path.exists() else source
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    t0 = time.perf_counter()
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        with transformers_build():  # one model built at a time (why: tokenfuse.bundled)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=_DTYPES[dtype], **kwargs)
            model.to(device)
    except OSError as err:
        raise ModelLoadError(
            f"member {name!r}: cannot load {source!r}{' (gguf_file=' + gguf_file + ')' if gguf_file else ''}: {err}. "
            "Give a local directory with config.json + safetensors, a .gguf file, or a bundled model name "
            "(see `tokenfuse models`); this machine cannot download from the hub."
        ) from err
    tj = Path(where) / "tokenizer.json"
    content_hash = hashlib.sha256(tj.read_bytes()).hexdigest() if (tj.is_file() and not gguf_file) else None
    member = TransformersMember(name, model, tokenizer, weight=weight, content_hash=content_hash,
                                align_cache=align_cache, batched=batched)
    member.load_seconds = time.perf_counter() - t0
    return member
