#!/usr/bin/env python
"""DeePEn on the three bundled models (llama.cpp): memory, build time, speed and approximation error.

    .venv/bin/python scripts/measure/measure_deepen.py [--main gemma3] [--steps-per-prompt 10] [--quick]

Phases
  1. anchors; row statistics (why a top-m sparse R̂ does not work with the reference's softmax);
  2. build (anchor matrices) cold in an empty cache and again from the cache;
  3. greedy DeePEn decoding of a few prompts, cold row store: per-step fuse time vs member forward
     time, rows computed, peak extra memory (anonymous RSS, so memory-mapped GGUF pages do not count);
     then the same run from the rows saved on disk (warm), recording every step's log-probs;
  4. on the recorded steps: each variant (kept mass / max rows / storage / sparse top-m / gd) vs
     a reference with exact float32 rows and a much larger support: argmax agreement and
     |Δ log-prob|; how often DeePEn changes the main member's choice and agrees with GaC's
     byte-exact average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from tokenfuse.combiners.deepen.relative import DEFAULT_CAPACITY, DEFAULT_COMPUTE_DTYPE, DeePEn, anchors
from tokenfuse.combiners.deepen.rows import RelativeRows
from tokenfuse.alignment.union import build_union
from tokenfuse.paths import cache_dir

SHORT = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m", "qwen": "qwen2.5-coder-0.5b-instruct"}
PROMPTS = [
    "The capital of France is",
    "Question: How many legs does a spider have?\nAnswer:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Water boils at a temperature of",
    "My favourite book is",
]


def anon_mb() -> float:
    """Anonymous resident memory of this process (MB): heap and tensors, not mapped files."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def load_members():
    from tokenfuse.config import MemberConfig
    from tokenfuse.load import load_member

    return [load_member(MemberConfig(name=s, source=f, backend="llamacpp"), progress=False) for s, f in SHORT.items()]


class Decoder:
    """Text-level greedy decoding: every member re-encodes prompt + output, reusing its KV cache prefix."""

    def __init__(self, members):
        self.members = members

    def start(self, prompt: str):
        self.prompt = prompt
        self.out = b""
        self.states = [m.new_state(m.encode_prompt(prompt)) for m in self.members]

    def logprobs(self) -> tuple[dict[int, torch.Tensor], float]:
        total = 0.0
        lps = {}
        for i, (m, st) in enumerate(zip(self.members, self.states)):
            ids = m.codec.encode_bytes(self.out)
            old = st.all_ids()
            new = st.prompt_ids + ids
            k = 0
            while k < min(len(old), len(new)) and old[k] == new[k]:
                k += 1
            st.ids = ids
            st.n_valid = min(st.n_valid, k)
            t = time.perf_counter()
            lps[i] = m.next_logprobs([st])
            total += time.perf_counter() - t
        return lps, total

    def finish(self):
        for m, st in zip(self.members, self.states):
            m.release(st)


def gac_choice(union, lps: dict[int, torch.Tensor]) -> int:
    """GaC's greedy union entry: the average of the members' text/END distributions over the union."""
    acc = torch.zeros(len(union), dtype=torch.float64)
    for i, lp in lps.items():
        mp = torch.from_numpy(np.asarray(union.maps[i][: lp.shape[1]]))
        ok = mp >= 0
        p = lp[0].double().exp() * ok
        acc.index_add_(0, mp[ok], (p / p.sum())[ok])
    return int(acc.argmax())


def sibling(mat: RelativeRows, *, capacity: int | None = None, row_dtype: torch.dtype | None = None,
            compute_dtype: torch.dtype | None = None) -> RelativeRows:
    """The same member and anchors with its own (empty, memory-only) row store; shares the anchor matrix."""
    dtype = mat.compute_dtype if compute_dtype is None else compute_dtype
    other = RelativeRows(mat.source, mat.anchor_ids, label=mat.label, compute_dtype=dtype,
                         temperature=mat.temperature, capacity=mat.capacity if capacity is None else capacity,
                         row_dtype=mat.row_dtype if row_dtype is None else row_dtype)
    other._anchors = mat.anchor_matrix.to(dtype)
    return other


def held_bytes(mat: RelativeRows) -> int:
    """Bytes a prepared matrix holds: the anchor matrix plus the stored rows."""
    anchors = mat.anchor_matrix
    return anchors.numel() * anchors.element_size() + mat.stored * mat.n_anchors * torch.finfo(mat.row_dtype).bits // 8


class TopM(RelativeRows):
    """Rows cut to their m largest anchors and renormalised (the sparse design the issue suggests)."""

    def __init__(self, base: RelativeRows, m: int, capacity: int):
        super().__init__(base.source, base.anchor_ids, temperature=base.temperature, capacity=capacity,
                         row_dtype=torch.float32, compute_dtype=base.compute_dtype, label=base.label)
        self._anchors = base.anchor_matrix
        self.m = m

    def compute(self, ids):
        rows = super().compute(ids)
        vals, idx = torch.topk(rows, self.m, dim=1)
        out = torch.zeros_like(rows)
        out.scatter_(1, idx, vals / vals.sum(1, keepdim=True))
        return out


def row_statistics(deepen: DeePEn, n: int = 256, seed: int = 0) -> None:
    print("\n## R̂ rows (T = %g, row L2-normalised): %d random rows per member" % (deepen.temperature, n))
    print("| member | V | exp-entropy (median) | max entry (median) | mass in top 64 / 1024 / 4096 anchors | "
          "fp16 store: max rel. err | max abs err | top-64 sparse: L1 | top-1024 sparse: L1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(seed)
    for mat in deepen.matrices:
        ids = np.sort(rng.choice(mat.source.n_rows, n, replace=False))
        exact = mat.compute(ids)
        probe = sibling(mat, capacity=n)
        approx = probe.rows(ids)
        ent = torch.exp(-(exact * exact.clamp_min(1e-30).log()).sum(1)).median().item()
        srt = exact.sort(dim=1, descending=True).values.cumsum(1)
        mass = [srt[:, k - 1].median().item() for k in (64, 1024, 4096)]
        rel = ((approx - exact).abs() / exact).max().item()
        absd = (approx - exact).abs().max().item()
        l1 = {k: (2 * (1 - srt[:, k - 1])).mean().item() for k in (64, 1024)}
        top = exact.max(1).values.median()
        print(f"| {mat.label} | {mat.source.n_rows} | {ent:,.0f} of {mat.n_anchors:,} | {top:.2e} "
              f"| {mass[0]:.4f} / {mass[1]:.4f} / {mass[2]:.4f} | {rel:.1e} | {absd:.1e} "
              f"| {l1[64]:.3f} | {l1[1024]:.3f} |")


def decode(deepen: DeePEn, dec: Decoder, union, steps: int, record: list | None) -> dict:
    """Greedy DeePEn decoding of PROMPTS; per-step timings; optionally records every step's inputs."""
    main = deepen.main
    fuse_ms, fwd_ms, rows_new, mem = [], [], [], []
    weights = {i: 1.0 for i in range(len(dec.members))}
    for prompt in PROMPTS:
        dec.start(prompt)
        for _ in range(steps):
            lps, fwd = dec.logprobs()
            misses = sum(m.misses for m in deepen.matrices)
            t = time.perf_counter()
            fused = deepen.fuse(lps, weights)
            fuse_ms.append(1000 * (time.perf_counter() - t))
            fwd_ms.append(1000 * fwd)
            rows_new.append(sum(m.misses for m in deepen.matrices) - misses)
            mem.append(anon_mb())
            choice = int(fused[0].argmax())
            if record is not None:
                record.append({i: lp.clone() for i, lp in lps.items()})
            piece = union.pieces[int(union.maps[main][choice])]
            if not piece:  # END
                break
            dec.out += piece
        dec.finish()
    return {"fuse": fuse_ms, "fwd": fwd_ms, "rows": rows_new, "mem": mem}


def summary(name: str, r: dict) -> None:
    f, w = np.array(r["fuse"]), np.array(r["fwd"])
    print(f"| {name} | {len(f)} | {np.median(f):.2f} | {np.percentile(f, 90):.2f} | {f.mean():.2f} | {np.median(w):.1f} "
          f"| {100 * f.mean() / w.mean():.1f} % | {np.mean(r['rows']):.1f} |")


def compare(steps: list, union, deepen: DeePEn, variants: dict, reference) -> None:
    main = deepen.main
    weights = {i: 1.0 for i in range(len(deepen.matrices))}
    ref_out = []
    saved = settings(deepen)
    settings(deepen, reference)
    t = time.perf_counter()
    for lps in steps:
        ref_out.append(deepen.fuse(lps, weights)[0])
    print(f"(reference: {len(steps)} steps in {time.perf_counter() - t:.0f} s)")
    gac = [gac_choice(union, lps) for lps in steps]
    own = [int(lps[main][0].argmax()) for lps in steps]
    ref_choice = [int(o.argmax()) for o in ref_out]
    to_u = union.maps[main]
    agree = sum(len({int(union.maps[i][int(lp[0].argmax())]) for i, lp in lps.items()}) == 1 for lps in steps)
    print(f"all members' greedy pieces agree at {agree}/{len(steps)} steps (an agreement skip would not fuse there)")
    print(f"reference: changes the main member's choice at {sum(a != b for a, b in zip(ref_choice, own))}/{len(steps)} "
          f"steps; equals GaC's choice at {sum(to_u[a] == g for a, g in zip(ref_choice, gac))}/{len(steps)} "
          f"(main alone: {sum(to_u[a] == g for a, g in zip(own, gac))}/{len(steps)})")
    print("\n| variant | argmax = reference | max / mean |Δ log-prob| on the reference's top 10 | changes main's choice "
          "| = GaC choice | fuse ms (median, warm) |")
    print("|---|---|---|---|---|---|")
    for name, variant in variants.items():
        settings(deepen, variant)
        for lps in steps:  # fill the row store so the timing below is the warm per-step cost
            deepen.fuse(lps, weights)
        same, dmax, dmean, changed, gac_eq, ms = 0, 0.0, [], 0, 0, []
        for lps, ref, g, o in zip(steps, ref_out, gac, own):
            t = time.perf_counter()
            out = deepen.fuse(lps, weights)[0]
            ms.append(1000 * (time.perf_counter() - t))
            c = int(out.argmax())
            same += c == int(ref.argmax())
            top = torch.topk(ref, 10).indices
            d = (out[top] - ref[top]).abs()
            dmax, dmean = max(dmax, float(d.max())), dmean + [float(d.mean())]
            changed += c != o
            gac_eq += to_u[c] == g
        n = len(steps)
        print(f"| {name} | {same}/{n} | {dmax:.3f} / {np.mean(dmean):.4f} | {changed}/{n} | {gac_eq}/{n} "
              f"| {statistics.median(ms):.2f} |")
    settings(deepen, saved)


def settings(deepen: DeePEn, values: tuple | None = None) -> tuple:
    """Read or set (matrices, mass, max_rows, update) of ``deepen``."""
    names = ("matrices", "mass", "max_rows", "update")
    if values is not None:
        for n, v in zip(names, values):
            setattr(deepen, n, v)
    return tuple(getattr(deepen, n) for n in names)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def best_of(fn, n: int = 5) -> float:
    """The fastest of ``n`` runs, ms: on a shared machine the least disturbed one."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def quiet_timings(deepen: DeePEn, members, steps: list, n_steps: int = 24) -> None:
    """Best-of-5 timings: warm fuse, one-token decode of each member, a batch of new rows."""
    weights = {i: 1.0 for i in range(len(members))}
    picks = steps[:: max(1, len(steps) // n_steps)][:n_steps]
    fuse = [best_of(lambda s=s: deepen.fuse(s, weights)) for s in picks]
    fwd = []
    for m in members:
        st = m.new_state(m.encode_prompt(PROMPTS[0] + " and it is a city with a long history."))
        m.next_logprobs([st])

        def one_token(m=m, st=st):
            st.n_valid -= 1  # the last position again: a one-token decode step
            m.next_logprobs([st])

        fwd.append(best_of(one_token, 7))
        m.release(st)
    rng = np.random.default_rng(0)
    new = []
    for mat in deepen.matrices:
        ids = rng.choice(mat.source.n_rows, 25, replace=False)
        new.append(best_of(lambda mat=mat, ids=ids: mat.compute(ids), 3))
    f = float(np.median(fuse))
    print("\n## Best-of-5 timings (the machine is shared; these approximate an idle one)")
    print(f"warm fuse, median over {len(picks)} steps of the best of 5: {f:.2f} ms (min {min(fuse):.2f}, max {max(fuse):.2f})")
    print("one-token decode, best of 7: " + ", ".join(f"{m.name} {t:.1f} ms" for m, t in zip(members, fwd))
          + f"; sum {sum(fwd):.1f} ms -> warm fuse = {100 * f / sum(fwd):.1f} % of the members' forward")
    print("25 new rows (a cold step's typical miss batch per member), best of 3: "
          + ", ".join(f"{m.label} {t:.1f} ms" for m, t in zip(deepen.matrices, new)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--main", default="gemma3", choices=list(SHORT))
    ap.add_argument("--steps-per-prompt", type=int, default=10)
    ap.add_argument("--ref-rows", type=int, default=256, help="reference support: rows per member and step")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 4 steps, fewer variants")
    args = ap.parse_args()
    if args.quick:
        del PROMPTS[2:]
        args.steps_per_prompt = 4
    torch.manual_seed(0)

    members = load_members()
    main_idx = list(SHORT).index(args.main)
    union = build_union([m.codec for m in members], cache=cache_dir() / "alignment")
    idx, _ = anchors(union)
    print(f"# DeePEn on {', '.join(m.name for m in members)} (llama.cpp); main: {args.main}; torch threads: "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"union {len(union):,} entries; anchors (single-token, byte-identical in all members): {len(idx):,}")
    dense = sum(m.n_vocab for m in members) * len(idx) * 4
    print("dense fp32 |V|×|A|: " + ", ".join(f"{m.name} {m.n_vocab * len(idx) * 4 / 2**30:.1f} GiB" for m in members)
          + f"; total {dense / 2**30:.1f} GiB")

    dec = Decoder(members)
    dec.start("Hello")  # llama.cpp contexts exist before the memory baseline
    dec.logprobs()
    dec.finish()

    with tempfile.TemporaryDirectory(prefix="deepen-measure-") as tmp:
        base = anon_mb()
        cold = DeePEn(members, union, main=main_idx, cache_dir=tmp)
        t = time.perf_counter()
        cold.prepare(progress=sys.stderr.isatty())
        t_cold = time.perf_counter() - t
        built = anon_mb() - base
        size = sum(m.anchor_matrix.numel() * m.anchor_matrix.element_size() for m in cold.matrices) / 2**20
        print(f"\n## Build (anchor matrices, {size:.0f} MB in {dtype_name(cold.matrices[0].compute_dtype)}): "
              f"cold {t_cold:.2f} s (empty cache: dequantise {len(idx):,} rows per member from the GGUFs), ", end="")
        warm = DeePEn(members, union, main=main_idx, cache_dir=tmp)
        t = time.perf_counter()
        warm.prepare(progress=False)
        print(f"cached {time.perf_counter() - t:.2f} s (from relative-<key>.npz); extra memory after build {built:.0f} MB")
        del warm

        row_statistics(cold)

        print(f"\n## Greedy DeePEn decoding ({len(PROMPTS)} prompts × ≤ {args.steps_per_prompt} steps, "
              f"T = {cold.steps}, η = {cold.lr}, update = {cold.update}, mass = {cold.mass}, ≤ {cold.max_rows} rows, "
              f"compute {dtype_name(cold.matrices[0].compute_dtype)}, fuse on {cold.threads} thread)")
        print("member forward = the three members one after the other (the engine runs them in threads)")
        print("| run | steps | fuse ms median | p90 | mean | member forward ms median | fuse / forward (means) "
              "| rows computed per step |")
        print("|---|---|---|---|---|---|---|---|")
        r_cold = decode(cold, dec, union, args.steps_per_prompt, None)
        summary("cold row store", r_cold)
        peak = max(r_cold["mem"]) - base
        held = sum(held_bytes(m) for m in cold.matrices) / 2**20
        cold.save()
        stored = sum(m.stored for m in cold.matrices)
        del cold
        other = (torch.bfloat16 if DEFAULT_COMPUTE_DTYPE == torch.float32 else torch.float32)
        with tempfile.TemporaryDirectory(prefix="deepen-measure-") as tmp2:
            alt = DeePEn(members, union, main=main_idx, cache_dir=tmp2, compute_dtype=other)
            alt.prepare(progress=False)
            summary(f"cold row store, compute {dtype_name(other)}",
                    decode(alt, dec, union, args.steps_per_prompt, None))
            del alt
        with tempfile.TemporaryDirectory(prefix="deepen-measure-") as tmp3:
            pre = DeePEn(members, union, main=main_idx, cache_dir=tmp3)
            pre.prepare(progress=False)
            before = anon_mb()
            t_pre = pre.prebuild(DEFAULT_CAPACITY, progress=sys.stderr.isatty())
            pre_mb = anon_mb() - before
            r_pre = decode(pre, dec, union, args.steps_per_prompt, None)
            summary(f"cold + prebuild(ids < {DEFAULT_CAPACITY}): {t_pre:.0f} s, +{pre_mb:.0f} MB", r_pre)
            full_peak = max(r_pre["mem"]) - base
            del pre
        again = DeePEn(members, union, main=main_idx, cache_dir=tmp)
        again.prepare(progress=False)
        steps: list = []
        r_warm = decode(again, dec, union, args.steps_per_prompt, steps)
        summary("rows saved by the cold run", r_warm)
        full = sum(m.anchor_matrix.numel() * m.anchor_matrix.element_size() + m.capacity * m.n_anchors * 2
                   for m in again.matrices) / 2**20
        print(f"\npeak extra memory (anonymous RSS over the baseline after loading the members): cold run {peak:.0f} MB "
              f"(DeePEn's own accounting: {held:.0f} MB = anchor matrices + {stored} stored rows in float16); "
              f"with full row stores (prebuild run) {full_peak:.0f} MB (accounting: {full:.0f} MB); "
              f"dense fp32 would be {dense / 2**30:.1f} GiB")

        quiet_timings(again, members, steps)

        print(f"\n## Approximations on the {len(steps)} recorded steps")
        ref_mats = [sibling(m, capacity=4 * args.ref_rows, row_dtype=torch.float32, compute_dtype=torch.float32)
                    for m in again.matrices]
        reference = (ref_mats, 1.0 - 1e-6, args.ref_rows, "adam")
        print(f"reference: exact float32 rows, the {args.ref_rows} most likely text/END tokens of every member "
              f"(≥ 1 − 1e-6 of the mass or {args.ref_rows} rows), adam")
        fp16 = again.matrices
        sup = (again.mass, again.max_rows)
        name = (f"default: mass {sup[0]}, ≤ {sup[1]} rows, "
                f"compute {dtype_name(again.matrices[0].compute_dtype)}")
        variants = {
            name: (fp16, *sup, "adam"),
            "mass 0.999, ≤ 64 rows": (fp16, 0.999, 64, "adam"),
            "mass 0.95, ≤ 16 rows": (fp16, 0.95, 16, "adam"),
            "mass 0.9999, ≤ 128 rows": (fp16, 0.9999, 128, "adam"),
            "gd (Eq. 7 as written), default support": (fp16, *sup, "gd"),
            f"compute {dtype_name(other)}, default support": (
                [sibling(m, compute_dtype=other, capacity=2048) for m in again.matrices], *sup, "adam"),
        }
        if not args.quick:
            for m_top in (64, 1024):
                variants[f"sparse top-{m_top} anchors (renormalised), default support"] = (
                    [TopM(m, m_top, 1024) for m in again.matrices], *sup, "adam")
        compare(steps, union, again, variants, reference)


if __name__ == "__main__":
    main()
