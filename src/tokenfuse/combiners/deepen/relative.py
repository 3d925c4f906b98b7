"""DeePEn (Huang et al. 2024, arXiv 2404.12715): fusion in a relative space, §3.2–3.5.

Each member's next-token distribution ``p_i`` goes to the relative space with its normalised
relative representation matrix, ``r_i = p_i · R̂_i`` (§3.2, Eq. 2, 4); the results are averaged,
``r̄ = Σ α_i r_i`` (§3.3, Eq. 5); the average goes back to the main member's vocabulary by a few
gradient steps on the main member's logits ``z`` minimising ``KL(r̄ ‖ softmax(z) · R̂_main)``
(§3.4, Eq. 6–7). The main member then picks (argmax or sampling) from the updated ``z``.

Relative representation (``tokenfuse.combiners.deepen.rows``)
    Anchors are the union entries every member has as one single token with exactly those bytes
    (``anchors``), so newline, byte-level Unicode and SentencePiece tokens match across families
    (the reference code matches raw token strings and misses all of them). Columns are ordered by
    union index, the same order for every member. ``R̂[w] = softmax(T · r_w / ‖r_w‖₂)`` with
    ``r_w = cos(e_w, e_anchors)`` on the input embeddings. The paper's Eq. 4 is a plain
    ``softmax(r_w)``; the reference code L2-normalises the row and multiplies by ``T = 100``
    before the softmax, and the published numbers come from that code, so that is our default.
    ``temperature`` exists because this choice sets how sharp the rows are: with our 38,547
    anchors the row norm is 20–100, so the effective inverse temperature on the cosines is only
    ~1–5 and every row is close to uniform (exp-entropy ≈ 38,000; its top 64 anchors hold
    0.2–0.3 % of its mass). A sparse top-m matrix therefore keeps almost nothing of a row (and
    measured, changes the fused choice at 15–17 of 80 steps), and a dense one needs 40 GB for
    Gemma-3; rows are instead computed on demand from the embeddings and kept in a bounded store
    (``RelativeRows``). The product that makes a new row runs in bfloat16 on CPUs with native
    bfloat16 dot products (``DEFAULT_COMPUTE_DTYPE``; 2–4× faster, ~1 % relative error per entry,
    the same fused choices as float32 on all 80 measured steps), else in float32.

Restriction to the tokens that carry mass (the one approximation)
    Per member and batch row only the most likely text/END tokens take part: the fewest that
    hold ``mass`` of the probability, at most ``max_rows``. Their probabilities are renormalised,
    so ``r_i`` is a mixture of ``R̂_i`` rows as in the paper. The inverse transformation moves
    the logits of the main member's kept tokens (softmax over them); all other logits keep their
    value relative to each other. Measured on 80 greedy steps of the bundled models against a
    reference with exact float32 rows and 256 tokens per member (``scripts/measure/measure_deepen.py``):
    mass 0.99 / 32 rows (default) gives the reference's choice at 77/80 steps, |Δ log-prob| on
    the reference's top 10 at most 0.66 (mean 0.049), 3.6 ms per warm step (~10 % of the three
    members' one-token decodes); 0.999 / 64 rows: 79/80, 0.34 (0.016), 7.1 ms; 0.95 / 16 rows:
    75/80, 1.07 (0.12), 2.4 ms; 0.9999 / 128 rows: 80/80, 0.11 (0.007), but new rows on most
    steps. The choice depends on the main member's cut, hardly on the others'; the same cut for
    every member keeps identical members an exact no-op.

Special ids
    Each member's distribution is renormalised over its text and END ids (ids the union maps to
    ``-1`` — BOS, pad, chat markers, unused — are dropped), as in GaC. END ids keep their own
    ``R̂`` rows (their embedding's similarity to the anchors). The returned main log-probs are
    ``-inf`` on the dropped ids.

Inverse transformation: deviation from Eq. 7
    Eq. 7 is plain gradient descent, ``z ← z − η ∇z``. Because the rows are so flat,
    ``∇z_w = π_w (1 − Σ_a R̂_wa r̄_a / q_a)`` is of order ``π_w · 10⁻²``: plain descent with the
    paper's η = 0.15 moves the logits by ~10⁻³ and (measured) changed the main member's choice
    at 0 of 80 steps, where the reference's optimiser changed it at 17. The
    reference code (``BasedOnProbabilityTransferLogits_Loacal_FP32_Processor``) actually runs
    ``torch.optim.AdamW(lr=η, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)`` with a
    ``CosineAnnealingLR(T_max=10, eta_min=η/4)`` schedule on ``nn.KLDivLoss()`` (mean over the
    anchors), and the paper's η values were tuned with it. ``update="adam"`` (default) is that
    optimiser written out analytically (same constants, same mean reduction, so the same η
    means the same thing); ``update="gd"`` is Eq. 7 on the logits with the summed KL. Both use the
    analytic gradient through softmax and the row mixture, no autograd.

Collaboration weights (§3.5)
    DeePEn-Avg: equal ``α``. DeePEn-Adapt: ``adapt_weights``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenfuse.combiners.deepen.rows import EmbeddingRows, RelativeRows
from tokenfuse.alignment.union import END, UnionVocab

DEFAULT_TEMPERATURE = 100.0
DEFAULT_STEPS = 5
DEFAULT_LR = 0.15
DEFAULT_MASS = 0.99
DEFAULT_MAX_ROWS = 32
DEFAULT_CAPACITY = 4096


def _native_bf16() -> bool:
    """The CPU has bfloat16 dot products (AVX512-BF16 or AMX): the bf16 product is 2–4× faster."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(bool(getattr(cpu, c)()) for c in checks if hasattr(cpu, c))
    except Exception:  # a private helper that changed: stay exact
        return False


DEFAULT_COMPUTE_DTYPE = torch.bfloat16 if _native_bf16() else torch.float32


@contextmanager
def _torch_threads(n: int | None):
    """Run a block with ``n`` torch threads (``None``: unchanged), restoring the setting after."""
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ---------------------------------------------------------------------------------------- anchors
def anchors(union: UnionVocab) -> tuple[np.ndarray, list[np.ndarray]]:
    """The anchor set: union entries (text, not END) that every member has as one single token.

    Returns ``(union_idx, member_ids)``: ``int64[A]`` union indices in increasing order and, per
    member, ``int64[A]`` its id for each anchor (its preferred id for those exact bytes).
    """
    inverse = np.stack([np.asarray(inv) for inv in union.inverse])
    ok = (inverse >= 0).all(axis=0)
    ok[END] = False
    idx = np.nonzero(ok)[0].astype(np.int64)
    return idx, [np.ascontiguousarray(inverse[i, idx]) for i in range(len(union.inverse))]


# ---------------------------------------------------------------------------------------- weights
def adapt_weights(accuracies: Mapping[str, float], n_choices: int | None = None, *,
                  floor: float = 1e-3) -> dict[str, float]:
    """DeePEn-Adapt collaboration weights (§3.5): ``α_i = s_i / Σ_j s_j``, ``s_i = acc_i − ε``.

    ``accuracies``: dev-set accuracy per member, as fractions in [0, 1]. ``n_choices``: ``K`` for a
    K-choice task (chance level ``ε = 1/K``), ``None`` or ``0`` for free-form generation
    (``ε = 0``). A member at or below chance would get a weight ≤ 0, which the paper does not
    define; it gets ``floor`` instead (before normalisation).
    """
    if not accuracies:
        raise ValueError("adapt_weights: no accuracies given")
    if n_choices is not None and n_choices != 0 and n_choices < 2:
        raise ValueError(f"adapt_weights: n_choices must be >= 2 (or None for free-form), got {n_choices}")
    bad = {k: v for k, v in accuracies.items() if not 0.0 <= float(v) <= 1.0}
    if bad:
        raise ValueError(f"adapt_weights: accuracies must be fractions in [0, 1] (not percentages): {bad}")
    chance = 1.0 / n_choices if n_choices else 0.0
    s = {k: max(float(v) - chance, floor) for k, v in accuracies.items()}
    total = sum(s.values())
    return {k: v / total for k, v in s.items()}


# ---------------------------------------------------------------------------------------- math
def kl_loss(target: torch.Tensor, q: torch.Tensor) -> float:
    """``KL(target ‖ q)`` summed over the anchors, in float64 (terms with ``target == 0`` are 0)."""
    t, q = target.double(), q.double()
    return float((t * (t.clamp_min(1e-300).log() - q.clamp_min(1e-300).log())).sum())


def inverse_transform(target: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, *,
                      steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR, update: str = "adam",
                      scale: float = 1.0, track_loss: bool = True, weight_decay: float = 0.01,
                      betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, t_max: int = 10,
                      min_lr_ratio: float = 0.25, schedule: bool = True) -> tuple[torch.Tensor, list[float], float]:
    """Search the logits whose relative representation is ``target`` (§3.4, Eq. 6–7).

    Minimises ``KL(target ‖ softmax(z) · R̂)`` from ``z = logits``; ``target``: ``float32[A]``,
    ``logits``: ``float32[K]``, ``rows``: ``float32[K, A]``, the K tokens' ``R̂`` rows times
    ``scale`` (the row store holds ``A · R̂``; passing ``scale=A`` saves a pass over them).

    ``update="adam"``: the reference's AdamW on the mean-reduced KL (see module docstring), with
    its cosine schedule (``t_max``, ``min_lr_ratio``; ``schedule=False``: constant ``lr``);
    ``update="gd"``: ``z ← z − lr · ∇z KL`` (Eq. 7; no weight decay, no schedule).

    Returns ``(z, losses, decay)``: the final logits; with ``track_loss`` the KL before each step
    and after the last (``steps + 1`` values, else ``[]``); the factor weight decay multiplied
    every logit by (1 for gd), for the caller to apply to logits outside the K.
    """
    if update not in ("adam", "gd"):
        raise ValueError(f"update must be 'adam' or 'gd', got {update!r}")
    z = logits.detach().float().clone()
    n_anchors = target.numel()
    m = torch.zeros_like(z)
    v = torch.zeros_like(z)
    losses: list[float] = []
    decay = 1.0
    for t in range(steps):
        pi = torch.softmax(z, dim=0)
        q = (pi @ rows).div_(scale)
        if track_loss:
            losses.append(kl_loss(target, q))
        s = (rows @ (target / q.clamp_min_(1e-30))).div_(scale)  # s_w = Σ_a R̂_wa r̄_a / q_a
        grad = pi * (pi @ s - s)  # ∂KL/∂z_w = π_w (s̄ − s_w), s̄ = Σ_v π_v s_v (= 1 when Σ target = 1)
        if update == "gd":
            z.sub_(grad, alpha=lr)
            continue
        step_lr = lr
        if schedule:
            low = lr * min_lr_ratio
            step_lr = low + (lr - low) * (1 + math.cos(math.pi * t / t_max)) / 2
        g = grad / n_anchors  # nn.KLDivLoss() averages over the anchors
        z.mul_(1 - step_lr * weight_decay)
        decay *= 1 - step_lr * weight_decay
        m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        m_hat = m / (1 - betas[0] ** (t + 1))
        v_hat = v / (1 - betas[1] ** (t + 1))
        z.sub_(step_lr * m_hat / (v_hat.sqrt() + eps))
    if track_loss:
        losses.append(kl_loss(target, (torch.softmax(z, dim=0) @ rows).div_(scale)))
    return z, losses, decay


# ---------------------------------------------------------------------------------------- DeePEn
@dataclass
class FuseStats:
    """Counters over all ``fuse`` calls (for reports)."""

    calls: int = 0
    rows: int = 0
    seconds: float = 0.0
    row_seconds: float = 0.0


class DeePEn:
    """DeePEn over tokenfuse members: aggregate in the relative space, invert into the main member.

    Args:
        members: the ensemble's members (``.name``; embeddings from ``.embedding_rows()``), in the
            union's order.
        union: their ``UnionVocab``.
        main: index of the main member (the one whose vocabulary the choice is made in).
        temperature: ``T`` of ``R̂`` (reference code: 100; see module docstring).
        steps, lr: ``T`` and ``η`` of the inverse transformation (paper and reference: 5, 0.15).
        update: ``"adam"`` (reference optimiser, default) or ``"gd"`` (Eq. 7 as written).
        mass, max_rows: per member and row, the kept tokens are the fewest holding ``mass`` of the
            probability, at most ``max_rows`` (see ``scripts/measure/measure_deepen.py``). The same cut for
            every member, so identical members fuse to exactly the member itself.
        capacity: ``R̂`` rows kept in memory per member (float16, ``2 · A`` bytes each).
        cache_dir: where anchor matrices and saved rows live (``None``: nothing on disk); the
            engine passes ``<cache>/alignment``.
        embeddings: per member index, an embedding table to use instead of the member's own
            (tests, or members without embeddings).
        row_dtype, compute_dtype: storage of kept rows and type of the product that makes new
            ones (see ``RelativeRows``).
        threads: torch threads inside ``fuse`` (set and restored around it; ``None``: leave
            torch's setting). The work is a few MB per step: one thread was measured fastest on
            the 2-core test machine, and two threads were 10× slower when the cores were busy.
    """

    def __init__(self, members: Sequence[Any], union: UnionVocab, *, main: int = 0,
                 temperature: float = DEFAULT_TEMPERATURE, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
                 update: str = "adam", mass: float = DEFAULT_MASS, max_rows: int = DEFAULT_MAX_ROWS,
                 capacity: int = DEFAULT_CAPACITY, cache_dir: str | Path | None = None,
                 embeddings: Mapping[int, torch.Tensor] | None = None, row_dtype: torch.dtype = torch.float16,
                 compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE, threads: int | None = 1) -> None:
        if len(members) != len(union.maps):
            raise ValueError(f"{len(members)} members but the union has {len(union.maps)} maps")
        if not 0 <= main < len(members):
            raise ValueError(f"main: {main} is not a member index (0..{len(members) - 1})")
        if update not in ("adam", "gd"):
            raise ValueError(f"update must be 'adam' or 'gd', got {update!r}")
        if not 0 < mass <= 1 or max_rows < 1 or steps < 0:
            raise ValueError("need 0 < mass <= 1, max_rows >= 1, steps >= 0")
        self.members = list(members)
        self.union = union
        self.main = main
        self.temperature = float(temperature)
        self.steps, self.lr, self.update = int(steps), float(lr), update
        self.mass, self.max_rows = float(mass), int(max_rows)
        self.anchor_union, anchor_ids = anchors(union)
        if len(self.anchor_union) == 0:
            raise ValueError("the members share no single-token text piece: DeePEn has no anchors")
        cache = Path(cache_dir) if cache_dir is not None else None
        embeddings = embeddings or {}
        self.matrices: list[RelativeRows] = []
        for i, m in enumerate(self.members):
            src = EmbeddingRows(tensor=embeddings[i]) if i in embeddings else m.embedding_rows()
            self.matrices.append(RelativeRows(src, anchor_ids[i], temperature=self.temperature, capacity=capacity,
                                              cache_dir=cache, row_dtype=row_dtype, compute_dtype=compute_dtype,
                                              label=m.name))
        self.threads = threads
        # ids the union drops (not text, not END): excluded from every distribution
        self._text = [torch.from_numpy(np.asarray(mp) >= 0) for mp in union.maps]
        self._dropped = [torch.from_numpy(np.nonzero(np.asarray(mp) < 0)[0]) for mp in union.maps]
        self.stats = FuseStats()
        self.track_loss = False
        self.last_losses: list[list[float]] = []
        self.build_seconds = 0.0

    @property
    def n_anchors(self) -> int:
        return len(self.anchor_union)

    def prepare(self, *, progress: bool = True) -> float:
        """Load or build every member's anchor matrix now (otherwise: on first use); returns seconds."""
        from tokenfuse.progress import progress_bar

        start = time.perf_counter()
        for mat in progress_bar(self.matrices, desc="DeePEn relative matrices", unit="member", enabled=progress):
            mat.prepare(progress=progress)
        self.build_seconds = time.perf_counter() - start
        return self.build_seconds

    def prebuild(self, n: int = DEFAULT_CAPACITY, *, progress: bool = True) -> float:
        """Compute each member's rows for its ids ``0 .. n-1`` now (frequent tokens come first in
        BPE and SentencePiece vocabularies: the first 4,096 ids were 53–66 % of the rows asked for
        in ``scripts/measure/measure_deepen.py``); ``save`` keeps them for later runs. Returns seconds."""
        start = time.perf_counter()
        for mat in self.matrices:
            mat.prebuild(np.arange(min(n, mat.source.n_rows)), progress=progress)
        return time.perf_counter() - start

    def save(self) -> list[Path]:
        """Write every member's computed rows to the disk cache (a later run starts warm)."""
        return [p for p in (m.save() for m in self.matrices) if p is not None]

    # ------------------------------------------------------------------ pieces
    def support(self, i: int, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept tokens of member ``i`` for one row of log-probs: ``(ids int64[k], probs float32[k])``.

        The fewest text/END tokens holding ``mass`` of the member's text/END probability, at most
        ``max_rows``; probabilities renormalised over them.
        """
        mass, max_rows = self.mass, self.max_rows
        lp = logprobs.float()
        text, dropped = self._mask(i, lp.numel())
        k = min(max_rows + min(len(dropped), 16), lp.numel())
        vals, ids = torch.topk(lp, k)
        if len(dropped):
            keep = text.index_select(0, ids)
            vals, ids = vals[keep], ids[keep]
        vals, ids = vals[:max_rows], ids[:max_rows]
        if ids.numel() == 0:
            raise ValueError(f"member {i}: no text token among its {k} most likely ids")
        p = vals.exp()
        total = 1.0 - (float(lp.index_select(0, dropped).exp().sum()) if len(dropped) else 0.0)
        if mass < 1.0 and total > 0:
            n = int(torch.searchsorted(torch.cumsum(p, 0), torch.tensor(mass * total)).item()) + 1
            p, ids = p[:n], ids[:n]
        return ids, p / p.sum()

    def _mask(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Member ``i``'s text/END mask over ``n`` log-probs and the ids outside it (ids past the
        tokenizer's table, e.g. padding rows of the output layer, are not text)."""
        text, dropped = self._text[i], self._dropped[i]
        if n == text.numel():
            return text, dropped
        text = torch.cat([text, torch.zeros(max(0, n - text.numel()), dtype=torch.bool)])[:n]
        return text, torch.nonzero(~text).flatten()

    def relative(self, i: int, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``r_i = p · R̂_i`` over the kept tokens ``ids`` with probabilities ``probs``, ``float32[A]``."""
        return (probs @ self.matrices[i].scaled_rows(ids.numpy())).div_(self.n_anchors)

    # ------------------------------------------------------------------ fuse
    def fuse(self, logprobs: Mapping[int, torch.Tensor], weights: Mapping[int, float]) -> torch.Tensor:
        """Fused next-token log-probs in the main member's vocabulary, ``float32[B, V_main]``.

        ``logprobs``: member index -> ``float32[B, V_i]`` full next-token log-probs (members that
        did not run this step are left out); ``weights``: member index -> collaboration weight
        ``α_i`` (normalised here over the members present with a positive weight). The main member
        must be present (its weight may be 0: then it only provides the vocabulary and start point).
        Ids the union drops are ``-inf`` in the result. With ``track_loss`` set, ``last_losses``
        holds each row's KL before each step and after the last.
        """
        with _torch_threads(self.threads):
            return self._fuse(logprobs, weights)

    def _fuse(self, logprobs: Mapping[int, torch.Tensor], weights: Mapping[int, float]) -> torch.Tensor:
        start = time.perf_counter()
        if self.main not in logprobs:
            raise ValueError(f"the main member ({self.main}) must be among the members that ran")
        present = [i for i in sorted(logprobs) if float(weights.get(i, 0.0)) > 0]
        if not present:
            raise ValueError("at least one member that ran needs a positive weight")
        total_w = sum(float(weights[i]) for i in present)
        main_lp = logprobs[self.main].float()
        batch = main_lp.shape[0]
        n_a = self.n_anchors
        # member by member (the main one last, so its rows are still in cache for the inverse):
        # one row request for the whole batch, the batch's relative representations, the rows freed
        targets = torch.zeros(batch, n_a)
        main_rows: tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor]] | None = None
        for i in [j for j in present if j != self.main] + [self.main]:
            kept = [self.support(i, logprobs[i][b]) for b in range(batch)]
            row_start = time.perf_counter()
            if batch == 1:
                ids, sel = kept[0][0], [None]
            else:
                ids, inv = torch.unique(torch.cat([k[0] for k in kept]), return_inverse=True)
                sel = list(torch.split(inv, [len(k[0]) for k in kept]))
            table = self.matrices[i].scaled_rows(ids.numpy())  # A · R̂
            self.stats.rows += len(ids)
            self.stats.row_seconds += time.perf_counter() - row_start
            if i in present:
                alpha = float(weights[i]) / total_w / n_a
                for b, (_, p) in enumerate(kept):
                    if sel[b] is None:
                        targets[b].add_(p @ table, alpha=alpha)
                    else:
                        w = torch.zeros(table.shape[0])
                        w[sel[b]] = p
                        targets[b].add_(w @ table, alpha=alpha)
            if i == self.main:
                main_rows = (table, sel, [k[0] for k in kept])
        table, sel, main_ids = main_rows
        out = main_lp.clone()
        self.last_losses = []
        for b in range(batch):
            ids = main_ids[b]
            rows = table if sel[b] is None else table.index_select(0, sel[b])
            z, losses, decay = inverse_transform(targets[b], main_lp[b].index_select(0, ids), rows, steps=self.steps,
                                                 lr=self.lr, update=self.update, scale=float(n_a),
                                                 track_loss=self.track_loss)
            self.last_losses.append(losses)
            if decay != 1.0:
                out[b].mul_(decay)
            out[b].index_copy_(0, ids, z)
        dropped = self._mask(self.main, out.shape[1])[1]
        if len(dropped):
            out.index_fill_(1, dropped, float("-inf"))
        out = torch.log_softmax(out, dim=-1)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return out
