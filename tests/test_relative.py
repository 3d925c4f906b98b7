"""DeePEn's relative representation, aggregation and inverse transformation (tokenfuse.combiners.deepen.relative).

Dense references here are written independently of the module: cosine matrices with
``F.cosine_similarity``, the inverse transformation with autograd and ``torch.optim.AdamW`` the
way the reference code runs it.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenfuse.combiners.deepen.relative import DeePEn, adapt_weights, anchors, inverse_transform
from tokenfuse.combiners.deepen.rows import EmbeddingRows, RelativeRows
from tokenfuse.members.gguf_file import gguf_tensor
from tokenfuse.alignment.union import UnionVocab, build_union

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------- helpers
def dense_rhat(emb: torch.Tensor, anchor_ids, temperature: float = 100.0) -> torch.Tensor:
    """R̂ of every row, the straightforward way (only for small tables)."""
    cos = torch.nn.functional.cosine_similarity(emb[:, None, :].double(), emb[anchor_ids][None, :, :].double(), dim=-1)
    cos = cos / cos.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.softmax(temperature * cos, dim=1).float()


def held_bytes(mat: RelativeRows) -> int:
    """Bytes a prepared matrix holds: the anchor matrix plus the stored rows."""
    anchors = mat.anchor_matrix
    return anchors.numel() * anchors.element_size() + mat.stored * mat.n_anchors * torch.finfo(mat.row_dtype).bits // 8


def reference_inverse(target, logits, rows, *, steps=5, lr=0.15):
    """The reference code's search: AdamW + cosine schedule on nn.KLDivLoss() (mean), autograd."""
    z = logits.detach().clone()[None].requires_grad_(True)
    opt = torch.optim.AdamW([z], lr=lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=lr / 4)
    crit = torch.nn.KLDivLoss()  # reduction "mean": over the anchors
    for _ in range(steps):
        q = torch.softmax(z, dim=-1) @ rows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note that "mean" is not "batchmean"
            loss = crit(torch.log(q), target[None])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return z.detach()[0]


def synthetic_union(v0: int = 600, v1: int = 500, shared: int = 300) -> UnionVocab:
    """Two members: ids < shared are the same pieces; member 0's last id is END, member 1's last is special."""
    p0 = [b"a%d" % i for i in range(v0 - 1)]
    p1 = [b"a%d" % i for i in range(shared)] + [b"b%d" % i for i in range(v1 - 1 - shared)]
    pieces = [b""] + sorted(set(p0) | set(p1))
    index = {p: i for i, p in enumerate(pieces)}
    m0 = np.array([index[p] for p in p0] + [0], dtype=np.int64)
    m1 = np.array([index[p] for p in p1] + [-1], dtype=np.int64)
    inverse = []
    for m, n in ((m0, v0), (m1, v1)):
        inv = np.full(len(pieces), -1, dtype=np.int64)
        for i in range(n - 1, -1, -1):
            if m[i] >= 0:
                inv[m[i]] = i
        inverse.append(inv)
    return UnionVocab(pieces, [m0, m1], inverse, np.ones(len(pieces), dtype=bool))


@pytest.fixture(scope="module")
def synthetic():
    g = torch.Generator().manual_seed(0)
    union = synthetic_union()
    embs = {0: torch.randn(600, 16, generator=g), 1: torch.randn(500, 12, generator=g)}
    members = [SimpleNamespace(name="m0"), SimpleNamespace(name="m1")]
    lps = {0: torch.log_softmax(3 * torch.randn(2, 600, generator=g), -1),
           1: torch.log_softmax(3 * torch.randn(2, 500, generator=g), -1)}
    return union, embs, members, lps


@pytest.fixture(scope="module")
def tiny_pair(make_tiny):
    """Two tiny random-weight members on the real SmolLM2 and Qwen tokenizers, their union, one real step."""
    a, b = make_tiny("smollm2", seed=3), make_tiny("qwen", seed=4)
    union = build_union([a.codec, b.codec])
    states = [m.new_state(m.codec.encode_text("The capital of France is")) for m in (a, b)]
    lps = {0: a.next_logprobs([states[0]]), 1: b.next_logprobs([states[1]])}
    return [a, b], union, lps


# ---------------------------------------------------------------------------------- anchors
def test_anchors_are_exactly_the_byte_common_single_tokens(make_tiny):
    members = [make_tiny("smollm2", seed=1), make_tiny("gemma3", seed=2)]
    union = build_union([m.codec for m in members])
    idx, ids = anchors(union)
    common = set.intersection(*({b for b in m.codec.token_bytes if b} for m in members))
    assert [union.pieces[u] for u in idx] == sorted(common)  # and ordered by union index (= by bytes)
    assert np.all(np.diff(idx) > 0) and 0 not in idx
    for m, member_ids in zip(members, ids):
        assert [m.codec.token_bytes[i] for i in member_ids] == sorted(common)
    # the tokens a raw-string match misses: newline, byte-level Unicode vs SentencePiece
    assert b"\n" in common and b" \xc3\xa9" in common or b"\xc3\xa9" in common
    assert len(idx) > 10_000


# ---------------------------------------------------------------------------------- rows
def test_rows_match_the_dense_computation():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(2000, 24, generator=g)
    emb[7] = 0  # an all-zero (padding) row: a uniform R̂ row, no NaN
    anchor_ids = np.sort(np.random.default_rng(0).choice(2000, 400, replace=False))
    dense = dense_rhat(emb, anchor_ids)
    assert torch.isfinite(dense).all()
    exact = RelativeRows(EmbeddingRows(tensor=emb), anchor_ids, capacity=2000, row_dtype=torch.float32)
    torch.testing.assert_close(exact.rows(np.arange(2000)), dense, rtol=1e-4, atol=1e-12)
    # float16 store (default): A·R̂ rounded to 11 bits (float16 subnormals below 2⁻¹⁴: 2⁻²⁴ absolute)
    store = RelativeRows(EmbeddingRows(tensor=emb), anchor_ids, capacity=2000)
    err = (store.rows(np.arange(2000)) - dense).abs()
    assert (err <= (2**-11 + 1e-4) * dense + 2**-24 / len(anchor_ids)).all()
    # bfloat16 product: the error grows with the rows' sharpness (these are far sharper than real ones,
    # where scripts/measure/measure_deepen.py measures L1 ≤ 0.003)
    bf = RelativeRows(EmbeddingRows(tensor=emb), anchor_ids, capacity=2000, compute_dtype=torch.bfloat16)
    assert (bf.rows(np.arange(2000)) - dense).abs().sum(1).max().item() < 0.1


def test_row_store_evicts_least_recently_used_and_stays_exact():
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(300, 8, generator=g)
    anchor_ids = np.arange(0, 300, 3)
    dense = dense_rhat(emb, anchor_ids)
    rr = RelativeRows(EmbeddingRows(tensor=emb), anchor_ids, capacity=50, row_dtype=torch.float32)
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.choice(300, rng.integers(1, 50), replace=True)
        torch.testing.assert_close(rr.rows(ids), dense[ids], rtol=1e-4, atol=1e-12)
        assert rr.stored <= 50
    big = np.arange(120)  # more than the store holds: computed directly, same numbers
    torch.testing.assert_close(rr.rows(big), dense[big], rtol=1e-4, atol=1e-12)
    rr.rows([1, 2])
    before = rr.misses
    rr.rows([2, 1])
    assert rr.misses == before  # recently used rows are still there


# ---------------------------------------------------------------------------------- inverse transformation
def test_adam_update_is_the_reference_optimiser():
    g = torch.Generator().manual_seed(3)
    rows = torch.softmax(torch.randn(40, 300, generator=g), 1)
    target = torch.softmax(torch.randn(300, generator=g), 0)
    logits = 2 * torch.randn(40, generator=g)
    ours, losses, _ = inverse_transform(target, logits, rows, steps=5, lr=0.15, update="adam")
    torch.testing.assert_close(ours, reference_inverse(target, logits, rows), rtol=1e-5, atol=1e-5)
    assert len(losses) == 6


def test_gd_update_is_eq7_with_the_autograd_gradient():
    g = torch.Generator().manual_seed(4)
    rows = torch.softmax(torch.randn(20, 100, generator=g), 1)
    target = torch.softmax(torch.randn(100, generator=g), 0)
    z = torch.randn(20, generator=g).requires_grad_(True)
    loss = torch.nn.functional.kl_div(torch.log(torch.softmax(z, 0) @ rows), target, reduction="sum")
    loss.backward()
    ours, losses, decay = inverse_transform(target, z.detach(), rows, steps=1, lr=0.5, update="gd")
    torch.testing.assert_close(ours, z.detach() - 0.5 * z.grad, rtol=1e-5, atol=1e-6)
    assert decay == 1.0 and losses[0] == pytest.approx(loss.item(), rel=1e-5)


def test_scaled_rows_give_the_same_search():
    g = torch.Generator().manual_seed(5)
    rows = torch.softmax(torch.randn(10, 64, generator=g), 1)
    target = torch.softmax(torch.randn(64, generator=g), 0)
    z = torch.randn(10, generator=g)
    a = inverse_transform(target, z, rows)
    b = inverse_transform(target, z, rows * 64, scale=64.0)
    torch.testing.assert_close(a[0], b[0])
    assert a[1] == pytest.approx(b[1], rel=1e-5)


@pytest.mark.parametrize("update", ["gd", "adam"])
def test_inverse_transformation_decreases_the_loss_monotonically_on_a_real_step(tiny_pair, update):
    members, union, lps = tiny_pair
    d = DeePEn(members, union, main=0, update=update, lr=0.15)
    d.track_loss = True
    d.fuse(lps, {0: 1.0, 1: 1.0})
    losses = d.last_losses[0]
    assert len(losses) == d.steps + 1
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---------------------------------------------------------------------------------- fuse
def test_full_support_fuse_equals_the_dense_reference(synthetic):
    union, embs, members, lps = synthetic
    d = DeePEn(members, union, main=0, embeddings=embs, mass=1.0, max_rows=10_000, row_dtype=torch.float32,
               compute_dtype=torch.float32)
    out = d.fuse(lps, {0: 2.0, 1: 1.0})
    idx, ids = anchors(union)
    rhat = [dense_rhat(embs[i], ids[i]) for i in range(2)]
    for b in range(2):
        target = torch.zeros(len(idx))
        for i, w in ((0, 2 / 3), (1, 1 / 3)):
            p = lps[i][b].exp() * torch.from_numpy(union.maps[i] >= 0)
            target += w * (p / p.sum()) @ rhat[i]
        z = lps[0][b].clone()  # member 0 has no dropped id (its last id is END)
        ref = torch.log_softmax(reference_inverse(target, z, rhat[0]), 0)
        torch.testing.assert_close(out[b], ref, rtol=1e-4, atol=1e-4)


def test_fuse_shapes_dropped_ids_and_weights(synthetic):
    union, embs, members, lps = synthetic
    d = DeePEn(members, union, main=1, embeddings=embs)
    out = d.fuse(lps, {0: 1.0, 1: 1.0})
    assert out.shape == (2, 500)
    assert out[:, 499].eq(float("-inf")).all()  # member 1's special id
    assert torch.isfinite(out[:, :499]).all()
    torch.testing.assert_close(out.exp().sum(1), torch.ones(2))
    # a member that did not run is left out; the main member alone with T = 0 is itself
    solo = DeePEn(members, union, main=1, embeddings=embs, steps=0).fuse({1: lps[1]}, {1: 1.0})
    expect = torch.log_softmax(lps[1][:, :499], -1)
    torch.testing.assert_close(solo[:, :499], expect)
    # an output layer wider than the tokenizer's table (padding rows): those ids are not text
    wide = torch.log_softmax(torch.cat([lps[0], torch.zeros(2, 10)], 1), -1)
    out = DeePEn(members, union, main=0, embeddings=embs).fuse({0: wide, 1: lps[1]}, {0: 1.0, 1: 1.0})
    assert out.shape == (2, 610) and out[:, 600:].eq(float("-inf")).all() and torch.isfinite(out[:, :600]).all()
    with pytest.raises(ValueError, match="main member"):
        d.fuse({0: lps[0]}, {0: 1.0})
    with pytest.raises(ValueError, match="positive weight"):
        d.fuse(lps, {0: 0.0, 1: 0.0})


def test_batch_rows_are_fused_independently(synthetic):
    union, embs, members, lps = synthetic
    d = DeePEn(members, union, main=0, embeddings=embs)
    both = d.fuse(lps, {0: 1.0, 1: 1.0})
    for b in range(2):
        one = d.fuse({i: lp[b : b + 1] for i, lp in lps.items()}, {0: 1.0, 1: 1.0})
        torch.testing.assert_close(both[b : b + 1], one)


def test_identical_members_return_the_members_own_greedy_choice(make_tiny):
    a, b = make_tiny("gemma3", seed=5, name="a"), make_tiny("gemma3", seed=5, name="b")
    union = build_union([a.codec, b.codec])
    d = DeePEn([a, b], union, main=0)
    d.track_loss = True
    for text in ("Hello", "The capital of France is", "def f(x):"):
        lp = a.next_logprobs([a.new_state(a.codec.encode_text(text))])
        out = d.fuse({0: lp, 1: lp.clone()}, {0: 1.0, 1: 1.0})
        text_ids = torch.from_numpy(union.maps[0] >= 0)
        own = torch.where(text_ids, lp[0], torch.tensor(float("-inf")))
        assert int(out[0].argmax()) == int(own.argmax())
        assert d.last_losses[0][0] < 1e-6  # r̄ is the main member's own relative representation
        # no gradient (up to float noise, which Adam's normalisation turns into steps of ~1e-3):
        # AdamW's weight decay scales every logit by Π (1 − η_t · 0.01)
        lrs = [0.15 / 4 + (0.15 - 0.15 / 4) * (1 + math.cos(math.pi * t / 10)) / 2 for t in range(5)]
        decay = math.prod(1 - lr * 0.01 for lr in lrs)
        top = torch.topk(own, 5).indices
        torch.testing.assert_close(out[0, top], torch.log_softmax(decay * own, 0)[top], atol=5e-3, rtol=0)


# ---------------------------------------------------------------------------------- weights
def test_adapt_weights_follow_section_3_5():
    w = adapt_weights({"a": 0.60, "b": 0.40}, n_choices=4)  # chance 1/4: s = 0.35, 0.15
    assert w == pytest.approx({"a": 0.7, "b": 0.3})
    w = adapt_weights({"a": 0.30, "b": 0.10})  # free-form: chance 0
    assert w == pytest.approx({"a": 0.75, "b": 0.25})
    assert adapt_weights({"a": 0.3, "b": 0.1}, n_choices=0) == pytest.approx(w)
    w = adapt_weights({"a": 0.70, "b": 0.20}, n_choices=4)  # b below chance: the floor, not a negative weight
    assert w["b"] == pytest.approx(1e-3 / (0.45 + 1e-3)) and sum(w.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="fractions"):
        adapt_weights({"a": 65.0})
    with pytest.raises(ValueError, match="n_choices"):
        adapt_weights({"a": 0.5}, n_choices=1)


# ---------------------------------------------------------------------------------- cache
def test_disk_cache_round_trip(synthetic, tmp_path):
    union, embs, members, lps = synthetic
    d = DeePEn(members, union, main=0, embeddings=embs, cache_dir=tmp_path)
    d.prepare(progress=False)
    first = d.fuse(lps, {0: 1.0, 1: 1.0})
    assert not any(m.from_cache for m in d.matrices)
    assert len(d.save()) == 2
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 4 and all(f.startswith("relative-") for f in files)
    again = DeePEn(members, union, main=0, embeddings=embs, cache_dir=tmp_path)
    again.prepare(progress=False)
    assert all(m.from_cache for m in again.matrices)
    for m0, m1 in zip(d.matrices, again.matrices):
        assert torch.equal(m0.anchor_matrix, m1.anchor_matrix)
    second = again.fuse(lps, {0: 1.0, 1: 1.0})
    assert torch.equal(first, second)
    assert sum(m.misses for m in again.matrices) == 0  # every row came from the saved store
    # other content, other key: different embeddings do not reuse the files
    other = DeePEn(members, union, main=0, embeddings={0: embs[0] + 1, 1: embs[1]}, cache_dir=tmp_path)
    other.prepare(progress=False)
    assert not other.matrices[0].from_cache and other.matrices[1].from_cache
    # a damaged file is rebuilt
    path = tmp_path / f"relative-{d.matrices[0].key}.npz"
    path.write_bytes(b"broken")
    fresh = DeePEn(members, union, main=0, embeddings=embs, cache_dir=tmp_path)
    fresh.prepare(progress=False)
    assert not fresh.matrices[0].from_cache
    assert torch.equal(fresh.matrices[0].anchor_matrix, d.matrices[0].anchor_matrix)


def test_embeddings_of_a_transformers_member_are_its_weight(make_tiny):
    m = make_tiny("smollm2", seed=1)
    e = m.input_embeddings()
    assert e.data_ptr() == m.model.get_input_embeddings().weight.data_ptr()  # no copy
    assert m.embedding_rows().take([5, 3]).equal(e[[5, 3]])


# ---------------------------------------------------------------------------------- real models
@pytest.mark.real
def test_gguf_rows_match_the_gguf_reader(llamacpp_members):
    import gguf

    m = llamacpp_members["smollm2"]
    rows, qtype, shape = gguf_tensor(m.path)
    reader = gguf.GGUFReader(m.path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert shape == (m.n_vocab, int(t.shape[0])) and qtype == t.tensor_type
    ids = np.array([0, 1, 17, 4000, m.n_vocab - 1])
    expect = gguf.quants.dequantize(t.data[ids], t.tensor_type)
    assert np.array_equal(m.embedding_rows().take(ids).numpy(), expect)
    for name in ("gemma3", "qwen"):
        e = llamacpp_members[name].embedding_rows()
        assert e.n_rows == llamacpp_members[name].n_vocab


@pytest.mark.real
def test_deepen_on_the_bundled_llamacpp_members(llamacpp_members, tmp_path):
    members = [llamacpp_members[k] for k in ("smollm2", "gemma3", "qwen")]
    union = build_union([m.codec for m in members])
    d = DeePEn(members, union, main=1, cache_dir=tmp_path)
    assert d.n_anchors > 30_000
    d.prepare(progress=False)
    assert sum(held_bytes(m) for m in d.matrices) < 400 * 2**20
    states = [m.new_state(m.encode_prompt("The capital of France is")) for m in members]
    lps = {i: m.next_logprobs([st]) for i, (m, st) in enumerate(zip(members, states))}
    d.track_loss = True
    out = d.fuse(lps, {0: 1.0, 1: 1.0, 2: 1.0})
    assert out.shape == (1, members[1].n_vocab)
    losses = d.last_losses[0]
    assert losses[-1] < losses[0]
    # the other two members both prefer " Paris"; Gemma alone prefers " the"
    pick = lambda i, lp: members[i].codec.token_bytes[int(lp[0].argmax())]  # noqa: E731
    assert pick(0, lps[0]) == pick(2, lps[2]) == b" Paris" != pick(1, lps[1])
    assert pick(1, out) == b" Paris"
    for m, st in zip(members, states):
        m.release(st)
