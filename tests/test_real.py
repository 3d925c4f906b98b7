"""Integration tests on the three real bundled models (converted into the cache on first use)."""

from __future__ import annotations

import pytest
import torch

from tokenfuse import Ensemble
from tokenfuse.members.transformers import TransformersMember

pytestmark = pytest.mark.real

PROMPT = "Question: What is the capital of France?\nAnswer:"
N = 12


def _copy(m: TransformersMember) -> TransformersMember:
    return TransformersMember(m.name + "-copy", m.model, m.tokenizer, weight=m.weight)


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_self_ensemble_reproduces_the_model_alone(real_members, family):
    m = real_members[family]
    alone = Ensemble([m]).generate(PROMPT, max_new_tokens=N)
    pair = Ensemble([m, _copy(m)]).generate(PROMPT, max_new_tokens=N)
    assert pair.output == alone.output
    assert pair.member_ids[m.name] == alone.member_ids[m.name]
    assert alone.steps == N or alone.finish_reason == "end"


def test_single_member_matches_transformers_generate(real_members):
    m = real_members["smollm2"]
    ids = torch.tensor([m.encode_prompt(PROMPT)])
    ref = m.model.generate(ids, max_new_tokens=N, do_sample=False, pad_token_id=m.tokenizer.eos_token_id)
    ref = ref[0, ids.shape[1]:].tolist()
    g = Ensemble([m]).generate(PROMPT, max_new_tokens=N)
    assert g.member_ids[m.name] == [t for t in ref if t not in m.codec.end_ids]


def test_default_ensemble_stays_in_sync_and_is_deterministic(real_members):
    members = list(real_members.values())
    ens = Ensemble(members)
    msgs = [{"role": "user", "content": "Say hello in Japanese, with an emoji."}]
    g = ens.generate(msgs, max_new_tokens=N)
    again = ens.generate(msgs, max_new_tokens=N)
    assert g.output == again.output and g.steps > 0
    assert g.ensembled_steps == g.steps
    for m in members:
        assert m.codec.decode(g.member_ids[m.name]) == g.output, m.name


def test_threshold_extremes_on_real_models(real_members):
    members = list(real_members.values())
    gate = members[0]
    alone = Ensemble([gate]).generate(PROMPT, max_new_tokens=N)
    full = Ensemble(members).generate(PROMPT, max_new_tokens=N)
    t0 = Ensemble(members, gate=gate.name, threshold=0.0).generate(PROMPT, max_new_tokens=N)
    t1 = Ensemble(members, gate=gate.name, threshold=1.0).generate(PROMPT, max_new_tokens=N)
    assert t0.output == alone.output and t0.ensembled_steps == 0
    assert t1.output == full.output and t1.ensembled_steps == t1.steps
    for m in members:  # lazy members were kept in sync on text
        assert m.codec.decode(t0.member_ids[m.name]) == t0.output


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "qwen"])
def test_fast_tokenizer_matches_auto_tokenizer(tokenizer_dirs, tokenizers, family):
    """The bundled members load their tokenizer with FastTokenizer; it must behave as AutoTokenizer."""
    from tokenfuse.members.codec import ByteCodec
    from tokenfuse.members.base import LocalMember
    from tokenfuse.members.fasttok import FastTokenizer

    fast, auto = FastTokenizer(tokenizer_dirs[family]), tokenizers[family]
    for text in [PROMPT, " leading space", "naïve café 😀 東京\n\n", "<|im_end|><eos> x", ""]:
        for special in (True, False):
            assert fast(text, add_special_tokens=special)["input_ids"] == \
                auto(text, add_special_tokens=special)["input_ids"], (text, special)
    assert (fast.eos_token_id, fast.bos_token_id, len(fast)) == (auto.eos_token_id, auto.bos_token_id, len(auto))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> 😀"}]
    assert bool(fast.chat_template) == bool(auto.chat_template)
    if auto.chat_template:
        assert fast.apply_chat_template(msgs, add_generation_prompt=True) == \
            auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    a, b = ByteCodec(fast, vocab_size=len(auto)), ByteCodec(auto, vocab_size=len(auto))
    assert (a.token_bytes, a.end_ids, a.special_ids, a.byte_ids) == (b.token_bytes, b.end_ids, b.special_ids, b.byte_ids)

    class _M(LocalMember):
        def _forward(self, state):  # never called
            raise AssertionError

    fm, am = _M(), _M()
    fm.tokenizer, am.tokenizer = fast, auto
    assert fm.render_chat(msgs) == am.render_chat(msgs)


def test_load_ensemble_builds_transformers_members_in_threads(real_members):
    """``load_ensemble`` loads members in threads; transformers builds each model under a device mode
    that is not private to a thread, so without ``TRANSFORMERS_BUILD_LOCK`` the three bundled models
    failed to load together ("Cannot copy out of meta tensor")."""
    from tokenfuse.bundled import DEFAULT_ENSEMBLE
    from tokenfuse.config import parse_config
    from tokenfuse.load import load_ensemble

    cfg = parse_config({"members": [{"name": n, "backend": "transformers"} for n in DEFAULT_ENSEMBLE]})
    ens = load_ensemble(cfg, progress=False)
    assert all(p.device.type == "cpu" for m in ens.members for p in m.model.parameters())
    expected = Ensemble(list(real_members.values())).generate(PROMPT, max_new_tokens=4).output
    assert ens.generate(PROMPT, max_new_tokens=4).output == expected
