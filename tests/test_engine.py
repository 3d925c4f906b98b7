"""The decoding loop on tiny random-weight members built on the real tokenizers.

Every test compares exact bytes / ids: against another ensemble that must be equivalent, against
plain transformers greedy decoding, or against the same call made another way (batch vs one by
one, stream vs generate).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tokenfuse.alignment.union import END
from tokenfuse.engine import Ensemble
from tokenfuse.engine.sampling import Sampling
from tokenfuse.errors import ConfigError
from tokenfuse.members.base import LocalMember, Member, SeqState, plain_chat
from tokenfuse.members.transformers import TransformersMember

FAMILIES = ("smollm2", "gemma3", "qwen")
PROMPTS = ("The capital of France is", "def fib(n):", "Once upon a time")
N = 20  # max_new_tokens for most tests: tiny models take a few ms per step


@pytest.fixture(scope="module")
def build(align_cache):
    """``build(members, **kw)``: an Ensemble sharing the session's on-disk alignment cache."""

    def make(members, **kw):
        return Ensemble(members, align_cache=align_cache, **kw)

    return make


@pytest.fixture(scope="module")
def tiny(make_tiny):
    """``make_tiny`` with the member objects kept for this module (building one hashes its tokenizer)."""
    made: dict = {}

    def get(family: str, *, seed: int = 0, name: str | None = None, weight: float = 1.0):
        key = (family, seed, name, weight)
        if key not in made:
            made[key] = make_tiny(family, seed=seed, name=name, weight=weight)
        return made[key]

    return get


@pytest.fixture(scope="module")
def trio(tiny):
    """Three tiny members, one per tokenizer family."""
    return tiny("smollm2", seed=0, name="A"), tiny("qwen", seed=1, name="B"), tiny("gemma3", seed=2, name="C")


@pytest.fixture(scope="module")
def eos(tiny, align_cache):
    return eos_lover(tiny, align_cache)


def in_sync(ens: Ensemble, g) -> None:
    """Every member's output ids decode to exactly the output bytes."""
    for m in ens.members:
        assert m.codec.decode(g.member_ids[m.name]) == g.output, m.name


def eos_lover(tiny, align_cache, *, family: str = "qwen", seed: int = 3, name: str = "eos") -> TransformersMember:
    """A member whose model puts almost all its mass on its end-of-sequence id (a biased lm_head)."""
    base = tiny(family, seed=seed)
    model = copy.deepcopy(base.model)  # never patch the session-shared tiny model
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True, device=old.weight.device)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[min(base.codec.end_ids)] = 30.0
    model.lm_head = head
    return TransformersMember(name, model, base.tokenizer, align_cache=align_cache)


pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedMember(LocalMember):
    """Emits ``chunks`` (each one of its tokens, split characters allowed) in order, then END.

    It borrows a tiny member's tokenizer and codec; its distribution puts all mass on the next
    chunk, found from the output bytes its ids cover (so re-tokenisation does not confuse it).
    """

    def __init__(self, name: str, base: Member, chunks: list[bytes]) -> None:
        self.name, self.codec, self.tokenizer, self.weight = name, base.codec, base.tokenizer, 1.0
        first: dict[bytes, int] = {}
        for i, b in enumerate(base.codec.token_bytes):
            if b and i not in base.codec.special_ids:
                first.setdefault(b, i)
        self.script = [first[c] for c in chunks]  # KeyError: not one token of this vocabulary
        self.offsets = [sum(len(c) for c in chunks[:k]) for k in range(len(chunks) + 1)]
        self.end = min(base.codec.end_ids)
        self.size = len(base.codec.token_bytes)

    def _forward(self, state: SeqState) -> torch.Tensor:
        k = self.offsets.index(state.covered)
        out = torch.full((self.size,), -1e4)
        out[self.script[k] if k < len(self.script) else self.end] = 0.0
        return out


# "Köln 日本!" with both multi-byte characters split across pieces
SPLIT_CHUNKS = [b"K", b"\xc3", b"\xb6", b"ln", b" ", b"\xe6", b"\x97", b"\xa5", b"\xe6\x9c\xac", b"!"]


# ---------------------------------------------------------------------------------------- 1. identities
@pytest.mark.parametrize("family,seed,prompt", [("smollm2", 0, PROMPTS[0]), ("gemma3", 1, PROMPTS[1]),
                                                ("qwen", 2, PROMPTS[2]), ("gemma3", 3, PROMPTS[0])])
def test_self_ensemble_reproduces_single_member(build, tiny, align_cache, family, seed, prompt):
    m = tiny(family, seed=seed, name="orig")
    twin = TransformersMember("twin", m.model, m.tokenizer, align_cache=align_cache)
    solo = build([m]).generate(prompt, max_new_tokens=N)
    both = build([m, twin]).generate(prompt, max_new_tokens=N)
    assert solo.steps == N and solo.finish_reason == "length" and solo.output
    assert both.output == solo.output
    assert both.text == solo.text
    assert both.member_ids["orig"] == solo.member_ids["orig"]
    assert both.member_ids["twin"] == solo.member_ids["orig"]
    assert (both.steps, both.finish_reason) == (solo.steps, solo.finish_reason)
    assert solo.ensembled_steps == 0 and both.ensembled_steps == N


@pytest.mark.parametrize("family,seed", [("smollm2", 0), ("gemma3", 1), ("qwen", 2)])
def test_single_member_matches_transformers_greedy(build, tiny, family, seed):
    m = tiny(family, seed=seed)
    ens = build([m])
    prompt_ids = m.encode_prompt(PROMPTS[0])
    # The engine never picks ids that are not text (special tokens, unused rows): suppress them in
    # transformers too; its end ids stop both.
    not_text = np.nonzero(ens.union.maps[0] < 0)[0].tolist()
    ends = sorted(m.codec.end_ids)
    out = m.model.generate(torch.tensor([prompt_ids], device=m.device),
                           attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=m.device),
                           max_new_tokens=N, do_sample=False, eos_token_id=ends, pad_token_id=ends[0],
                           suppress_tokens=not_text)
    hf = out[0, len(prompt_ids):].tolist()
    ended = bool(hf) and hf[-1] in ends
    if ended:
        hf = hf[:-1]
    g = ens.generate(PROMPTS[0], max_new_tokens=N)
    assert g.member_ids[m.name] == hf
    assert g.output == m.codec.decode(hf)
    assert g.steps == len(hf) == N
    assert g.finish_reason == ("end" if ended else "length")


class OlderForward(torch.nn.Module):
    """The same causal LM behind the forward of an older transformers: its KV cache is ``past_key_values``."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.config, self.generation_config = lm, lm.config, lm.generation_config
        self.caches = []

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0):
        self.caches.append(past_key_values)
        # the cache is the fourth argument under either name (input_ids, attention_mask, position_ids, cache)
        return self.lm(input_ids, attention_mask, position_ids, past_key_values, use_cache=use_cache,
                       logits_to_keep=logits_to_keep)


@pytest.mark.parametrize("batched", [True, False])
def test_the_kv_cache_goes_by_the_name_the_models_forward_takes(build, tiny, align_cache, batched):
    """A forward of this transformers gets its cache as it names it (no deprecation warning); one whose
    forward says ``past_key_values`` gets it so, every call, and decodes the same. Unbatched it is
    the sequence's own cache every call; batched, each call's view of the member's row store."""
    import warnings

    from transformers import Cache

    m = tiny("qwen", seed=2, name="new")
    m = TransformersMember("new", m.model, m.tokenizer, align_cache=align_cache, batched=batched)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = build([m]).generate(PROMPTS[1], max_new_tokens=N)
    wrapped = OlderForward(m.model)
    old = build([TransformersMember("new", wrapped, m.tokenizer, align_cache=align_cache, batched=batched)]).generate(
        PROMPTS[1], max_new_tokens=N)
    assert old.member_ids == new.member_ids and old.output == new.output and old.steps == N
    assert len(wrapped.caches) == N and all(isinstance(c, Cache) for c in wrapped.caches)
    assert all(c is wrapped.caches[0] for c in wrapped.caches) != batched


# ---------------------------------------------------------------------------------------- 2. weights
def test_zero_weight_member_changes_nothing_and_stays_in_sync(build, tiny, trio, monkeypatch):
    a, b, _ = trio
    c = tiny("gemma3", seed=2, name="C0", weight=0.0)
    calls = []
    original = c._forward_batch
    monkeypatch.setattr(c, "_forward_batch", lambda states: calls.append(1) or original(states))  # never run at weight 0
    for prompt in PROMPTS[:2]:
        ref = build([a, b]).generate(prompt, max_new_tokens=N)
        ens = build([a, b, c])
        g = ens.generate(prompt, max_new_tokens=N)
        assert g.output == ref.output and g.steps == ref.steps == N
        assert g.member_ids["A"] == ref.member_ids["A"] and g.member_ids["B"] == ref.member_ids["B"]
        assert g.ensembled_steps == ref.ensembled_steps == N
        assert c.codec.decode(g.member_ids["C0"]) == g.output
        in_sync(ens, g)
    assert calls == []


def test_weights_matter(build, trio):
    """Sanity for the test above: re-weighting live members does change the output."""
    a, b, _ = trio
    ens = build([a, b])
    even = ens.generate(PROMPTS[0], max_new_tokens=N)
    solo_b = build([b]).generate(PROMPTS[0], max_new_tokens=N)
    skewed = build([a, b], weights=[50.0, 1.0]).generate(PROMPTS[0], max_new_tokens=N)  # the ensemble's weights
    assert a.weight == 1.0 and ens.weights == [1.0, 1.0]  # the member's own default is never written
    solo_a = build([a]).generate(PROMPTS[0], max_new_tokens=N)
    assert skewed.output == solo_a.output
    assert even.output != solo_a.output and even.output != solo_b.output


def test_ensemble_rejects_bad_setups(trio):
    a, b, _ = trio
    with pytest.raises(ConfigError, match="^members"):
        Ensemble([])
    with pytest.raises(ConfigError, match="unique"):
        Ensemble([a, a])
    with pytest.raises(ConfigError, match="^threshold: gate 'A' needs a threshold"):
        Ensemble([a, b], gate="A")
    with pytest.raises(ConfigError, match="'nobody' is not a member"):
        Ensemble([a, b], gate="nobody", threshold=0.5)
    with pytest.raises(ConfigError, match="method.*available: byte, contrast, deepen, gac, unite"):
        Ensemble([a, b], method="gak")


# ---------------------------------------------------------------------------------------- 3. thresholded
def test_threshold_zero_is_the_gate_alone(build, trio):
    a, b, c = trio
    for prompt in PROMPTS[:2]:
        alone = build([a]).generate(prompt, max_new_tokens=N)
        ens = build([a, b, c], gate="A", threshold=0.0)
        g = ens.generate(prompt, max_new_tokens=N)
        assert g.output == alone.output and g.member_ids["A"] == alone.member_ids["A"]
        assert g.steps == N and g.ensembled_steps == 0
        in_sync(ens, g)


def test_threshold_one_is_the_full_ensemble(build, trio):
    a, b, c = trio
    full = build([a, b, c]).generate(PROMPTS[0], max_new_tokens=N)
    ens = build([a, b, c], gate="A", threshold=1.0)
    g = ens.generate(PROMPTS[0], max_new_tokens=N)
    assert g.output == full.output and g.member_ids == full.member_ids
    assert g.steps == full.steps == N
    assert g.ensembled_steps == full.ensembled_steps == N
    in_sync(ens, g)


def test_intermediate_threshold_mixes_and_lazy_members_catch_up(build, trio):
    a, b, c = trio
    ens = build([a, b, c], gate="A", threshold=0.06)
    g = ens.generate(PROMPTS[0], max_new_tokens=N)
    full = build([a, b, c]).generate(PROMPTS[0], max_new_tokens=N)
    alone = build([a]).generate(PROMPTS[0], max_new_tokens=N)
    assert g.steps == N
    assert g.ensembled_steps == 10  # the gate (smollm2, seed 0) is confident (top > 0.06) on 10 of 20 steps
    assert g.output not in (full.output, alone.output)
    in_sync(ens, g)
    events = list(ens.steps([PROMPTS[0]], max_new_tokens=N, sampling=Sampling()))
    assert sum(e.ensembled for e in events) == 10
    assert b"".join(e.piece for e in events) == g.output


def test_events_describe_the_generation(build, trio):
    a, b, c = trio
    ens = build([a, b, c])
    events = list(ens.steps(list(PROMPTS[:2]), max_new_tokens=7, sampling=Sampling()))
    g = ens.generate(list(PROMPTS[:2]), max_new_tokens=7)
    for i in range(2):
        mine = [e for e in events if e.index == i]
        assert len(mine) == 7 and [e.finished for e in mine] == [None] * 6 + ["length"]
        assert b"".join(e.piece for e in mine) == g[i].output


# ---------------------------------------------------------------------------------------- 4. finishing
def _stop_from(text: str, start: int) -> str:
    """A 3-character ASCII slice of ``text`` at or after ``start``."""
    for i in range(start, len(text) - 3):
        s = text[i:i + 3]
        if s.isascii() and s.isprintable():
            return s
    raise AssertionError(f"no ASCII slice in {text!r}")


@pytest.mark.parametrize("members,prompt", [("A", PROMPTS[0]), ("AB", PROMPTS[1]), ("ABC", PROMPTS[2])])
def test_stop_string_trims_at_first_occurrence(build, trio, members, prompt):
    ens = build([m for m in trio if m.name in members])
    full = ens.generate(prompt, max_new_tokens=N)
    assert full.finish_reason == "length"
    stops = []
    for start in (len(full.text) // 3, len(full.text) // 2):
        stop = _stop_from(full.text, start)
        cut = full.output.find(stop.encode())
        g = ens.generate(prompt, max_new_tokens=N, stop=[stop])
        assert g.finish_reason == "stop"
        assert g.output == full.output[:cut]
        assert stop not in g.text
        assert g.steps <= full.steps
        # the same with a stop string that never occurs next to it
        g2 = ens.generate(prompt, max_new_tokens=N, stop=["\x00never", stop])
        assert (g2.output, g2.finish_reason) == (g.output, "stop")
        in_sync(ens, g)
        stops.append(stop)
    # several stop strings: the earliest occurrence wins, whatever their order
    g = ens.generate(prompt, max_new_tokens=N, stop=stops[::-1])
    assert g.output == full.output[:min(full.output.find(s.encode()) for s in stops)]


def test_stop_string_spanning_pieces(build, trio):
    a, b, c = trio
    ens = build([a, b, c])
    events = list(ens.steps([PROMPTS[0]], max_new_tokens=N, sampling=Sampling()))
    pieces = [e.piece for e in events]
    full = b"".join(pieces)
    # the last byte of one piece plus the first two of the next, all ASCII
    k = next(k for k in range(3, N - 1) if pieces[k][-1:].isascii() and pieces[k + 1][:2].isascii()
             and len(pieces[k + 1]) >= 2 and pieces[k][-1:] != b"")
    stop = (pieces[k][-1:] + pieces[k + 1][:2]).decode()
    cut = full.find(stop.encode())
    g = ens.generate(PROMPTS[0], max_new_tokens=N, stop=[stop])
    assert g.finish_reason == "stop" and g.output == full[:cut]
    assert g.steps == next(i + 1 for i in range(N) if len(b"".join(pieces[:i + 1])) >= cut + len(stop))
    in_sync(ens, g)


def test_long_stop_string_reaching_back_past_the_window(build, trio):
    """A stop string spanning many pieces: every member must give back ids beyond its window."""
    a, b, c = trio
    ens = build([a, b, c], window=2)
    events = list(ens.steps([PROMPTS[0]], max_new_tokens=N, sampling=Sampling()))
    pieces = [e.piece for e in events]
    full = b"".join(pieces)
    start = len(b"".join(pieces[:4]))
    end = len(b"".join(pieces[:12])) - 1  # completed by piece 12, starts at piece 5
    stop = full[start:end].decode("utf-8", errors="ignore")
    assert len(stop) > 20 and full.find(stop.encode()) == start
    g = ens.generate(PROMPTS[0], max_new_tokens=N, stop=[stop])
    assert (g.output, g.steps, g.finish_reason) == (full[:start], 12, "stop")
    in_sync(ens, g)
    assert "".join(ens.stream(PROMPTS[0], max_new_tokens=N, stop=[stop])) == g.text


def test_max_new_tokens(build, trio):
    a, b, _ = trio
    ens = build([a, b])
    long = ens.generate(PROMPTS[1], max_new_tokens=N)
    for n in (1, 5, 12):
        g = ens.generate(PROMPTS[1], max_new_tokens=n)
        assert (g.steps, g.finish_reason) == (n, "length")
        assert long.output.startswith(g.output) and len(g.output) < len(long.output)
        in_sync(ens, g)


def test_end_alone(build, eos):
    e = eos
    g = build([e]).generate(PROMPTS[0], max_new_tokens=N)
    assert (g.output, g.steps, g.finish_reason, g.member_ids) == (b"", 0, "end", {"eos": []})


def test_end_after_some_text(build, tiny, eos):
    """Gate A runs alone while confident; when it is not, the EOS-lover joins and END wins."""
    a, e = tiny("smollm2", seed=1, name="A1"), eos
    alone = build([a]).generate("Hello, world", max_new_tokens=N)
    ens = build([a, e], gate="A1", threshold=0.035)
    g = ens.generate("Hello, world", max_new_tokens=N)
    # the gate's top probabilities: .039 .163 .042 .049 .060 .072 .076 .065 .185 | .028 -> END
    assert (g.finish_reason, g.steps, g.ensembled_steps) == ("end", 9, 0)
    assert g.member_ids["A1"] == alone.member_ids["A1"][:9]
    assert g.output == a.codec.decode(alone.member_ids["A1"][:9])
    for m in (a, e):
        assert not set(g.member_ids[m.name]) & m.codec.end_ids
        for t in m.codec.end_ids:
            assert m.tokenizer.convert_ids_to_tokens(t).encode() not in g.output
    in_sync(ens, g)
    # the full ensemble (no gate) ends at once; END never counts as a step
    g0 = build([a, e]).generate("Hello, world", max_new_tokens=N)
    assert (g0.output, g0.steps, g0.ensembled_steps, g0.finish_reason) == (b"", 0, 0, "end")


def test_end_in_a_batch_does_not_disturb_the_others(build, tiny, eos):
    a, e = tiny("smollm2", seed=1, name="A1"), eos
    ens = build([a, e], gate="A1", threshold=0.035)
    prompts = ["Hello, world", PROMPTS[0], PROMPTS[1]]
    batch = ens.generate(prompts, max_new_tokens=N)
    singles = [ens.generate(p, max_new_tokens=N) for p in prompts]
    assert [(g.output, g.finish_reason, g.steps) for g in batch] == \
           [(g.output, g.finish_reason, g.steps) for g in singles]
    assert batch[0].finish_reason == "end"


# ---------------------------------------------------------------------------------------- 5. sampling
def test_seeded_sampling_is_deterministic(build, trio):
    a, b, _ = trio
    ens = build([a, b])
    s = Sampling(temperature=1.0, top_p=0.95, seed=7)
    g1 = ens.generate(PROMPTS[0], max_new_tokens=N, sampling=s)
    g2 = ens.generate(PROMPTS[0], max_new_tokens=N, sampling=s)
    g3 = ens.generate(PROMPTS[0], max_new_tokens=N, sampling=Sampling(temperature=1.0, top_p=0.95, seed=8))
    greedy = ens.generate(PROMPTS[0], max_new_tokens=N)
    assert (g1.output, g1.member_ids) == (g2.output, g2.member_ids)
    assert g1.output != g3.output
    assert g1.output != greedy.output
    in_sync(ens, g1)
    in_sync(ens, g3)


@pytest.mark.parametrize("seed", [0, 5])
def test_top_k_one_is_greedy(build, trio, seed):
    a, b, _ = trio
    ens = build([a, b])
    greedy = ens.generate(PROMPTS[2], max_new_tokens=N)
    g = ens.generate(PROMPTS[2], max_new_tokens=N, sampling=Sampling(temperature=1.3, top_k=1, seed=seed))
    assert (g.output, g.member_ids) == (greedy.output, greedy.member_ids)
    tiny_p = ens.generate(PROMPTS[2], max_new_tokens=N, sampling=Sampling(temperature=0.7, top_p=1e-6, seed=seed))
    assert tiny_p.output == greedy.output


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=50, seed=3)],
                         ids=["greedy", "sampled"])
def test_batch_equals_one_by_one(build, trio, sampling):
    a, b, c = trio
    ens = build([a, b, c])
    stop = ["Lean", "no s"]  # ends some sequences early, so the batch shrinks while others run
    batch = ens.generate(list(PROMPTS), max_new_tokens=12, sampling=sampling)
    singles = [ens.generate(p, max_new_tokens=12, sampling=sampling) for p in PROMPTS]
    assert len(batch) == 3
    assert len({g.output for g in batch}) == 3
    for g, s in zip(batch, singles):
        assert (g.output, g.steps, g.ensembled_steps, g.finish_reason, g.member_ids) == \
               (s.output, s.steps, s.ensembled_steps, s.finish_reason, s.member_ids)
    batch = ens.generate(list(PROMPTS), max_new_tokens=12, sampling=sampling, stop=stop)
    singles = [ens.generate(p, max_new_tokens=12, sampling=sampling, stop=stop) for p in PROMPTS]
    assert [(g.output, g.finish_reason) for g in batch] == [(s.output, s.finish_reason) for s in singles]
    assert {g.finish_reason for g in batch} == {"stop", "length"}


# ---------------------------------------------------------------------------------------- 6. streaming, chat
@pytest.mark.parametrize("members,prompt,sampling,stop", [
    ("A", PROMPTS[0], Sampling(), ()),
    ("C", PROMPTS[1], Sampling(), ()),
    ("AB", PROMPTS[2], Sampling(temperature=1.0, seed=11), ()),
    ("ABC", PROMPTS[0], Sampling(), ("an",)),
    ("BC", PROMPTS[1], Sampling(temperature=0.9, seed=2), ("e", "qq")),
    ("AC", "日本語のテキスト", Sampling(), ()),
])
def test_stream_equals_generate(build, trio, members, prompt, sampling, stop):
    ens = build([m for m in trio if m.name in members])
    g = ens.generate(prompt, max_new_tokens=N, sampling=sampling, stop=list(stop))
    pieces = list(ens.stream(prompt, max_new_tokens=N, sampling=sampling, stop=list(stop)))
    assert "".join(pieces) == g.text
    assert all(pieces)
    if "\ufffd" not in g.text:
        assert not any("\ufffd" in p for p in pieces)
    for s in stop:
        assert not any(s in p for p in pieces)


def test_stream_never_splits_a_character(build, tiny):
    """Byte-level members emit pieces that are parts of characters; the stream holds them back."""
    seen_multibyte = False
    checked = 0
    for family, seed in (("smollm2", 4), ("qwen", 5), ("gemma3", 6), ("qwen", 7)):
        ens = build([tiny(family, seed=seed)])
        for prompt in ("Schreib über Köln: ", "日本語で"):
            g = ens.generate(prompt, max_new_tokens=N)
            pieces = list(ens.stream(prompt, max_new_tokens=N))
            assert "".join(pieces) == g.text
            if "\ufffd" not in g.text:
                checked += 1
                assert not any("\ufffd" in p for p in pieces)
                seen_multibyte |= any(len(p.encode()) > len(p) for p in pieces)
    assert checked >= 4 and seen_multibyte


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_holds_back_split_characters(build, tiny, family):
    ens = build([ScriptedMember("script", tiny(family, seed=0), SPLIT_CHUNKS)])
    g = ens.generate("x", max_new_tokens=N)
    assert (g.output, g.text, g.steps, g.finish_reason) == (b"".join(SPLIT_CHUNKS), "Köln 日本!", 10, "end")
    assert list(ens.stream("x", max_new_tokens=N)) == ["K", "ö", "ln", " ", "日", "本", "!"]
    # a partial stop string is held back too, and never shown once the stop completes
    assert list(ens.stream("x", max_new_tokens=N, stop=["本!"])) == ["K", "ö", "ln", " ", "日"]
    assert ens.generate("x", max_new_tokens=N, stop=["本!"]).text == "Köln 日"
    # two stop strings completed by the same piece ("ln"): the earlier one wins
    for stops in (["l", "n"], ["n", "l"], ["ln", "n"]):
        g = ens.generate("x", max_new_tokens=N, stop=stops)
        assert (g.text, g.steps, g.finish_reason) == ("Kö", 4, "stop")
    assert list(ens.stream("x", max_new_tokens=N, stop=["ln 日X"])) == ["K", "ö", "ln 日本", "!"]
    # cut by the length limit inside a character: the stream ends with what generate gives
    cut = ens.generate("x", max_new_tokens=6)
    assert cut.output == b"K\xc3\xb6ln \xe6" and cut.finish_reason == "length"
    assert "".join(ens.stream("x", max_new_tokens=6)) == cut.text == "Köln \ufffd"


def test_split_characters_keep_every_member_in_sync(build, tiny):
    """Other tokenizers follow a byte-by-byte character (raw byte tokens, then re-tokenised)."""
    script = ScriptedMember("script", tiny("qwen", seed=0), SPLIT_CHUNKS)
    ens = build([script, tiny("gemma3", seed=2, name="g0", weight=0.0), tiny("smollm2", seed=0, name="s0", weight=0.0)])
    for stop, text in (([], "Köln 日本!"), (["本!"], "Köln 日"), (["ö"], "K")):
        g = ens.generate("x", max_new_tokens=N, stop=stop)
        assert g.text == text
        in_sync(ens, g)
        assert "".join(ens.stream("x", max_new_tokens=N, stop=stop)) == text
    for n in range(1, 10):  # stopped by the length limit at every point, inside characters too
        g = ens.generate("x", max_new_tokens=n)
        assert g.output == b"".join(SPLIT_CHUNKS[:n]) and g.steps == n
        for m in ens.members:  # a member may hold back an unfinished character's bytes
            got = m.codec.decode(g.member_ids[m.name])
            assert g.output.startswith(got) and len(g.output) - len(got) < 4, (n, m.name)


def test_chat_with_and_without_template(build, trio, tokenizers):
    a, _, c = trio  # a: smollm2 (chat template), c: gemma3 (no template in this tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert c.render_chat(msgs) == ("System: Be brief.\n\nUser: Hi there\n\nAssistant:", False)
    assert plain_chat([{"role": "user", "content": "Hi"}]) == "User: Hi\n\nAssistant:"
    text, templated = a.render_chat(msgs)
    assert templated and "Hi there" in text and text != plain_chat(msgs)

    ens = build([a, c])
    seqs = [ens.open(msgs, max_new_tokens=1)]
    ens.step(seqs)
    expected_a = tokenizers["smollm2"](a.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                                       add_special_tokens=False)["input_ids"]
    assert seqs[0].states[0].prompt_ids == list(expected_a)
    assert seqs[0].states[1].prompt_ids == c.encode_prompt(plain_chat(msgs))

    g = ens.generate(msgs, max_new_tokens=N)
    assert g.steps == N
    in_sync(ens, g)
    # a plain string with chat=True is one user message
    user = [{"role": "user", "content": "Hi there"}]
    assert ens.generate("Hi there", chat=True, max_new_tokens=N).output == ens.generate(user, max_new_tokens=N).output
    # a batch of conversations
    batch = ens.generate([msgs, user], max_new_tokens=N)
    assert [x.output for x in batch] == [g.output, ens.generate(user, max_new_tokens=N).output]


def test_two_form_prompt_gives_each_member_its_own_form(build, trio):
    from tokenfuse import TwoFormPrompt

    a, _, c = trio  # a has a chat template, c has none
    msgs = [{"role": "user", "content": "Q: 2+2?"}]
    raw = "Question: 2+2?\nAnswer:"
    ens = build([a, c])
    seqs = [ens.open(TwoFormPrompt(msgs, raw), max_new_tokens=1)]
    ens.step(seqs)
    text, _ = a.render_chat(msgs)
    assert seqs[0].states[0].prompt_ids == a.encode_prompt(text, templated=True)
    assert seqs[0].states[1].prompt_ids == c.encode_prompt(raw)  # not the plain "User: ..." rendering
    g = ens.generate(TwoFormPrompt(msgs, raw), max_new_tokens=N)  # a single prompt, not a batch
    assert g.steps == N
    in_sync(ens, g)
    # without a template the chat prompt is exactly the documented plain rendering
    only_c = build([c])
    assert only_c.generate(msgs, max_new_tokens=N).output == only_c.generate(plain_chat(msgs), max_new_tokens=N).output
    assert "".join(only_c.stream(msgs, max_new_tokens=N)) == only_c.generate(msgs, max_new_tokens=N).text


def test_timings_cover_the_stages(build, trio):
    a, b, _ = trio
    g = build([a, b]).generate(PROMPTS[0], max_new_tokens=5)
    assert set(g.timings) == {"forward", "align", "combine", "choose", "resync", "total", "other"}
    assert all(v >= 0 for k, v in g.timings.items() if k != "other")
    assert g.timings["total"] >= g.timings["forward"] > 0


def test_end_union_entry_is_shared(build, trio):
    a, b, c = trio
    ens = build([a, b, c])
    assert ens.union.pieces[END] == b""
    for i, m in enumerate(ens.members):
        for t in m.codec.end_ids:
            assert ens.union.maps[i][t] == END


def test_member_pool_shares_the_cores_among_members_side_by_side(members, monkeypatch):
    """Members forwarded side by side split the cores and a member that finishes first leaves its
    share to the others; one member alone, or members one after another, get them all."""
    import threading

    from tokenfuse.engine.pool import MemberPool

    share = {}
    for m in members:
        monkeypatch.setattr(m, "share_cores", lambda n, name=m.name: share.__setitem__(name, n), raising=False)
    pool = MemberPool(members, parallel=True)
    monkeypatch.setattr(pool, "cores", 4)
    seen, a_done, both_read = {}, threading.Event(), threading.Barrier(2)

    def work(i):
        name = members[i].name
        if name != "A":
            a_done.wait(10)
            threading.Event().wait(0.2)  # A's callback has run by then
        seen.setdefault(name, []).append(share[name])
        if name != "A":
            both_read.wait(10)  # neither B nor C finishes before both have read their share
        return i

    try:
        pool.run([0, 1, 2], lambda i: (work(i), a_done.set() if i == 0 else None)[0])
        assert seen == {"A": [1], "B": [2], "C": [2]}
        pool.run([1], lambda i: i)
        assert share["B"] == 4
    finally:
        pool.shutdown()
    seq = MemberPool(members, parallel=False)
    seq.cores = 4
    share.clear()
    seq.run([0, 1], lambda i: share.get(members[i].name))
    assert share == {"A": 4, "B": 4}
