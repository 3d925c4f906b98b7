"""One KV cache for every sequence of a transformers member: many rows in one forward.

``RowStore`` keeps, per layer, one key and one value tensor ``[slots, kv_heads, length, head_dim]``:
each open sequence owns a slot (``RowStore.take``), and position ``j`` of its ids lives at index
``j`` of its slot. The cache's validity is the sequence's own ``SeqState.n_valid``: a rollback
only lowers it, and the next forward writes from there on, so any row can roll back to any
position without touching the others (what the engine's re-sync and speculative rounds need).

``forward_rows`` feeds many rows in one model call: each row's pending ids right-padded to the
longest, its own position ids, and a 4-D attention mask that lets query ``t`` of row ``r``
(position ``p = n_valid_r + t``) see the keys at indices ``0 .. p`` of its slot (and, on a
sliding-window layer of window ``W``, only those above ``p - W``, as transformers' own
``sliding_window_overlay``). Keys past a row's length hold stale or padding values; the mask
never lets a real query see them, and a padding query sees only finite values (new slots are
zeros), so no NaN can reach a real row. Only the logits of the positions asked for are computed
(``logits_to_keep`` as an index tensor).

Why not transformers' own caches: ``DynamicCache`` holds one batch of equal-length rows and crops
them all together; ``StaticCache`` likewise keeps one write position for the whole batch; the
paged cache of continuous batching (``PagedAttentionCache``) is driven by its own scheduler and
request manager and has no call to truncate one request to a given position. This store is the
small piece they lack: per-row lengths with per-row rollback; everything else (the attention
kernels, ``logits_to_keep``, 4-D masks, position ids) is the library's.

The numbers of a row equal the one-sequence-per-forward path's (``DynamicCache``) up to
floating-point rounding, not bit for bit: the CPU's matrix products round a ``[rows, d]`` product
otherwise than a ``[1, d]`` one (another kernel), and the attention sums over masked extra keys in
another order. Measured in fp32 on tiny random-weight members of the three bundled architectures
(log-probabilities down to -30): at most 8.4e-6 of a log-probability's magnitude (tests/test_row_cache.py
checks 2e-5), with the same greedy choices. A member with ``batched: false`` keeps the
one-sequence path and its numbers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tokenfuse.members.base import SeqState


class Slot:
    """A sequence's place in a ``RowStore`` (kept in ``SeqState.cache``); given back when released
    or garbage-collected."""

    def __init__(self, store: RowStore, index: int) -> None:
        self.store, self.index = store, index
        self._finalizer = weakref.finalize(self, store.give, index)

    def free(self) -> None:
        self._finalizer()


class RowStore:
    """Keys and values of every sequence of one model, one tensor per layer (see the module docstring).

    Tensors grow (to the next power of two of slots, and of positions from 64 on) when a forward
    needs more; a slot given back is reused, lowest index first, so the rows of a batch that opened
    together sit side by side and the attention reads them without a copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.slots = 0  # slots the tensors hold
        self.length = 0  # positions per slot the tensors hold
        self._free: list[int] = []
        self._next = 0

    def take(self) -> Slot:
        if self._free:
            self._free.sort()
            return Slot(self, self._free.pop(0))
        self._next += 1
        return Slot(self, self._next - 1)

    def give(self, index: int) -> None:
        self._free.append(index)

    def clear(self) -> None:
        """Free the tensors (the member was unloaded)."""
        self.keys, self.values, self.slots, self.length = [], [], 0, 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def reserve(self, slots: int, length: int) -> None:
        """Make room for ``slots`` slots of ``length`` positions (each layer's tensors follow at its
        next write)."""
        if slots > self.slots:
            self.slots = _grow(slots, 1)
        if length > self.length:
            self.length = _grow(length, 64)

    def layer(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s key and value tensors at the reserved size (``like``: new keys
        ``[rows, kv_heads, positions, head_dim]``, for the shape and dtype)."""
        while len(self.keys) <= i:
            self.keys.append(None)
            self.values.append(None)
        k = self.keys[i]
        if k is None or k.shape[0] < self.slots or k.shape[2] < self.length:
            shape = (self.slots, like.shape[1], self.length, like.shape[3])
            for tensors in (self.keys, self.values):
                new = torch.zeros(shape, dtype=like.dtype, device=self.device)
                old = tensors[i]
                if old is not None:
                    new[: old.shape[0], :, : old.shape[2]] = old
                tensors[i] = new
        return self.keys[i], self.values[i]


def _grow(n: int, floor: int) -> int:
    size = floor
    while size < n:
        size *= 2
    return size


@dataclass
class _Step:
    """One forward's rows: their slots, where each row's new ids start, and the keys' length."""

    store: RowStore
    slots: torch.Tensor  # int64[R], increasing
    starts: torch.Tensor  # int64[R]: n_valid of each row
    width: int  # T: positions fed per row (padded)
    kv_length: int  # keys the attention reads per row: max(start) + T
    contiguous: bool  # slots are one range: the attention reads a view of the store

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.store.layer(layer, key)
        t = torch.arange(self.width, device=ks.device)
        pos = self.starts.to(ks.device)[:, None] + t  # [R, T]
        rows = self.slots.to(ks.device)[:, None].expand_as(pos)
        ks[rows, :, pos] = key.transpose(1, 2)
        vs[rows, :, pos] = value.transpose(1, 2)
        if self.contiguous:
            a = int(self.slots[0])
            sel = slice(a, a + len(self.slots))
            return ks[sel, :, : self.kv_length], vs[sel, :, : self.kv_length]
        idx = self.slots.to(ks.device)
        return ks.index_select(0, idx)[:, :, : self.kv_length], vs.index_select(0, idx)[:, :, : self.kv_length]


class _StepLayer(CacheLayerMixin):
    """One layer of a ``_StepCache``: writes into the store, returns the rows' keys and values."""

    is_sliding = False
    is_croppable = False

    def __init__(self, step: _Step, index: int) -> None:
        super().__init__()
        self.step, self.index = step, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing: the store allocates."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.step.update(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.kv_length, 0

    def get_seq_length(self) -> int:
        return self.step.kv_length - self.step.width

    def get_max_length(self) -> int:
        return -1


class _StepCache(Cache):
    """The cache a model sees during one ``forward_rows`` call."""

    def __init__(self, step: _Step, layers: int) -> None:
        super().__init__(layers=[_StepLayer(step, i) for i in range(layers)])


def attention_masks(config, starts: torch.Tensor, width: int, kv_length: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive ``[R, 1, T, K]`` masks of one forward: a tensor, or one per layer type for a model
    with sliding-window layers (transformers' models take such a dict as prepared masks)."""
    pos = starts.to(device)[:, None] + torch.arange(width, device=device)  # [R, T] query positions
    key = torch.arange(kv_length, device=device)
    causal = key[None, None, :] <= pos[:, :, None]  # [R, T, K]
    low = torch.finfo(dtype).min

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, low)[:, None]

    types = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" not in types:
        return additive(causal)
    window = int(config.sliding_window)
    sliding = causal & (key[None, None, :] > pos[:, :, None] - window)
    masks = {"sliding_attention": additive(sliding)}
    for kind in types - {"sliding_attention"}:
        masks[kind] = additive(causal)
    return masks


def forward_rows(model, store: RowStore, states: Sequence[SeqState], ends: Sequence[Sequence[int]], *,
                 cache_arg: str) -> list[list[torch.Tensor]]:
    """Feed every row's pending ids in one forward; for each row, the next-token log-probabilities
    (``float32[V]`` on the CPU) after the first ``L`` ids of its sequence for each ``L`` in its
    ``ends`` (increasing, within ``(n_valid, length]``). The rows' states then hold their whole
    sequences (``mark_cached`` is the caller's)."""
    for st in states:
        if not isinstance(st.cache, Slot):
            st.cache, st.n_valid = store.take(), 0
    order = sorted(range(len(states)), key=lambda r: states[r].cache.index)
    rows = [states[r] for r in order]
    device = store.device
    width = max(st.pending for st in rows)
    starts = [st.n_valid for st in rows]
    slots = [st.cache.index for st in rows]
    kv_length = max(starts) + width
    store.reserve(max(slots) + 1, kv_length)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, st in enumerate(rows):
        new = st.all_ids()[st.n_valid :]
        ids[r, : len(new)] = torch.tensor(new, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long)
    step = _Step(store, torch.tensor(slots, dtype=torch.long), starts_t, width, kv_length,
                 contiguous=slots == list(range(slots[0], slots[0] + len(slots))))
    text = model.config.get_text_config()
    layers = text.num_hidden_layers
    wanted = [[n - 1 - st.n_valid for n in ends[r]] for r, st in zip(order, rows)]
    keep = sorted({t for w in wanted for t in w})
    col = {t: c for c, t in enumerate(keep)}
    dtype = next(model.parameters()).dtype
    masks = attention_masks(text, starts_t, width, kv_length, dtype, device)
    positions = (starts_t[:, None] + torch.arange(width)).to(device)
    out = model(input_ids=ids.to(device), attention_mask=masks, position_ids=positions, use_cache=True,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                **{cache_arg: _StepCache(step, layers)})
    logp = torch.log_softmax(out.logits.float(), dim=-1).cpu()  # [R, len(keep), V]
    result: list[list[torch.Tensor]] = [[] for _ in states]
    for r, (w, orig) in enumerate(zip(wanted, order)):
        result[orig] = [logp[r, col[t]] for t in w]
    return result


def batches(states: Sequence[SeqState], *, waste: float = 1.25) -> list[list[int]]:
    """Indices of ``states`` grouped into forwards: the rows with one pending id together, the others
    in groups whose padding costs at most ``waste`` times their own positions (so a new prompt does
    not pad a step's decoding rows to its length)."""
    ones = [r for r, st in enumerate(states) if st.pending <= 1]
    longer = sorted((r for r, st in enumerate(states) if st.pending > 1), key=lambda r: -states[r].pending)
    groups = [ones] if ones else []
    group: list[int] = []
    for r in longer:
        trial = group + [r]
        if group and states[trial[0]].pending * len(trial) > waste * sum(states[j].pending for j in trial):
            groups.append(group)
            trial = [r]
        group = trial
    if group:
        groups.append(group)
    return groups
