"""The batched transformers forward (``tokenfuse.members.row_cache``) against one sequence per forward.

A batched member and an unbatched one share one tiny random-weight model on a real tokenizer; random
interleavings of open / step / rollback / close of up to 8 rows must give the unbatched
log-probabilities (fp32, within 2e-5 of their magnitude, at least 1: ``close``) and the same greedy
choices. The bound is relative because the difference is the CPU's matrix products rounding
``[rows, d]`` products otherwise than ``[1, d]`` ones (a one-row product takes another kernel): it
grows with the logits, and these random members' log-probabilities reach -30 (measured: at most
8.4e-6 of the magnitude, 8.4e-5 absolute, over 60 steps of 8 rows per architecture). The architectures are the bundled
members' (Llama for SmolLM2, Qwen2, Gemma-3 with sliding-window layers, window 4 so that it matters).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from conftest import TEST_DEVICE
from tokenfuse.members.row_cache import RowStore, batches
from tokenfuse.members.transformers import TransformersMember

TOL = 2e-5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got - want).abs() <= TOL * want.abs().clamp_min(1.0)).all())


def _model(kind: str, vocab: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4, initializer_range=0.5,
                  max_position_embeddings=2048)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **common)).eval().to(TEST_DEVICE)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, **common)).eval().to(TEST_DEVICE)
    cfg = Gemma3TextConfig(num_hidden_layers=3, num_key_value_heads=1, head_dim=8, sliding_window=4,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common)
    return Gemma3ForCausalLM(cfg).eval().to(TEST_DEVICE)


FAMILY = {"llama": "smollm2", "qwen2": "qwen", "gemma3": "gemma3"}


@pytest.fixture(scope="module")
def pairs(tokenizers, align_cache, one_thread):
    """Per architecture: (batched member, unbatched member) on one model."""
    out = {}
    for kind, fam in FAMILY.items():
        tok = tokenizers[fam]
        model = _model(kind, len(tok))
        out[kind] = (TransformersMember(f"{kind}-b", model, tok, align_cache=align_cache),
                     TransformersMember(f"{kind}-u", model, tok, align_cache=align_cache, batched=False))
    return out


OPS = hs.lists(hs.one_of(
    hs.tuples(hs.just("open"), hs.integers(1, 9)),
    hs.tuples(hs.just("step"), hs.just(0)),
    hs.tuples(hs.just("rollback"), hs.integers(0, 7)),
    hs.tuples(hs.just("close"), hs.integers(0, 7)),
), min_size=4, max_size=18)


@pytest.mark.parametrize("kind", list(FAMILY))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=hs.integers(0, 2**16))
def test_interleavings_give_the_one_by_one_numbers(pairs, kind, ops, seed):
    batched, plain = pairs[kind]
    assert batched.batched and not plain.batched
    gen = torch.Generator().manual_seed(seed)
    vocab = len(batched.tokenizer)
    rows: list[tuple] = []  # (batched state, unbatched state)
    for op, arg in ops + [("step", 0)]:
        if op == "open" and len(rows) < 8:
            prompt = torch.randint(vocab, (arg,), generator=gen).tolist()
            rows.append((batched.new_state(prompt), plain.new_state(prompt)))
        elif op == "step" and rows:
            got = batched.next_logprobs([a for a, _ in rows])
            want = plain.next_logprobs([b for _, b in rows])
            assert close(got, want)
            choice = got.argmax(-1)
            assert torch.equal(choice, want.argmax(-1))  # the same greedy choice on every row
            for (a, b), c in zip(rows, choice.tolist()):
                a.ids.append(c)
                b.ids.append(c)
        elif op == "rollback" and rows:
            a, b = rows[arg % len(rows)]
            k = min(len(a.ids), 1 + arg % 3)
            keep = a.length - k
            for st in (a, b):  # re-sync: drop the last k ids, the cache keeps at most what stays
                del st.ids[len(st.ids) - k:]
                st.drop_cache_after(keep)
        elif op == "close" and rows:
            a, b = rows.pop(arg % len(rows))
            batched.release(a)
            plain.release(b)
    for a, b in rows:
        batched.release(a)
        plain.release(b)


@pytest.mark.parametrize("kind", list(FAMILY))
def test_one_forward_scoring_goes_through_the_batched_call(pairs, kind):
    """``logprobs_at`` (one-forward scoring, speculative verification) on the row store gives every
    position's one-by-one numbers, after a rollback into the middle of the sequence too."""
    batched, plain = pairs[kind]
    ids = torch.randint(len(batched.tokenizer), (14,), generator=torch.Generator().manual_seed(7)).tolist()
    a, b = batched.new_state(ids[:3]), plain.new_state(ids[:3])
    for st in (a, b):
        st.ids = ids[3:]
    ends = [4, 9, 14]
    assert close(batched.logprobs_at(a, ends), plain.logprobs_at(b, ends))
    for st in (a, b):
        st.ids = ids[3:8] + ids[:4]
        st.drop_cache_after(8)
    assert close(batched.logprobs_at(a, [10, 12]), plain.logprobs_at(b, [10, 12]))
    batched.release(a)
    plain.release(b)


def test_slots_are_reused_lowest_first():
    """A released sequence's slot goes to the next one, lowest index first."""
    store = RowStore(torch.device("cpu"))
    s = [store.take() for _ in range(3)]
    assert [x.index for x in s] == [0, 1, 2]
    s[1].free()
    assert store.take().index == 1
    del s[0]  # garbage-collected: given back too
    assert store.take().index == 0


def test_a_new_prompt_does_not_pad_the_decoding_rows():
    from tokenfuse.members.base import SeqState

    states = [SeqState(prompt_ids=[1] * n) for n in (1, 1, 40, 38, 5, 1)]  # pending: every id
    assert batches(states) == [[0, 1, 5], [2, 3], [4]]
