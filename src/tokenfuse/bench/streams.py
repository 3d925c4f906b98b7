"""The streams section of ``tokenfuse bench`` and each member's memory.

``measure_streams``: for each count N, N prompts (the prompt set cycled) stepped together, as
``Ensemble.generate`` steps a list of prompts (every member gets the rows of all unfinished sequences
in one ``next_logprobs`` call), against the same prompts generated one at a time: tokens/s with the
prefill and decode-only, the ratio, and how many of the N outputs equal the prompt's output generated
alone. ``member_memory`` and the ``cuda_*`` readers: weight and CUDA memory, never initialising CUDA.
"""

from __future__ import annotations

import sys
import time

from tokenfuse.engine import Ensemble
from tokenfuse.engine.sampling import Sampling
from tokenfuse.progress import progress_bar


# ------------------------------------------------------------------ memory
def _cuda_devices() -> list[int]:
    """The CUDA devices of this process, where it has initialised CUDA: never imports torch nor
    initialises CUDA (the llama.cpp path has neither)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


def cuda_allocated_bytes() -> int | None:
    """Bytes the process has allocated on its CUDA devices now (``torch.cuda.memory_allocated``,
    summed), ``None`` where it uses no CUDA."""
    devices = _cuda_devices()
    return sum(sys.modules["torch"].cuda.memory_allocated(d) for d in devices) if devices else None


def cuda_peak_bytes(*, reset: bool = False) -> int | None:
    """The most the process has allocated on its CUDA devices (``torch.cuda.max_memory_allocated``,
    summed) since the start or the last ``reset``; ``None`` where it uses no CUDA. ``reset`` starts a
    new peak (``torch.cuda.reset_peak_memory_stats``) after reading this one."""
    devices = _cuda_devices()
    if not devices:
        return None
    cuda = sys.modules["torch"].cuda
    peak = sum(cuda.max_memory_allocated(d) for d in devices)
    if reset:
        for d in devices:
            cuda.reset_peak_memory_stats(d)
    return peak


def _mb(n: int) -> float:
    return round(n / 2**20, 1)


def cuda_peak_mb(*sections: dict) -> float | None:
    """The process's peak CUDA allocation so far in MiB, ``None`` where it uses no CUDA: the peak since
    the last reset, and the peaks the streams ``sections`` (``measure_streams``, which resets it per
    batch) recorded before and during their batches."""
    peak = cuda_peak_bytes()
    if peak is None:
        return None
    return max([_mb(peak)] + [s.get("cuda_peak_before_mb", 0.0) for s in sections]
               + [r.get("cuda_peak_mb", 0.0) for s in sections for r in s["rows"]])


def member_memory(member, cuda_before: int | None = None) -> dict:
    """A loaded member's memory, in MiB: ``weights_mb``, its ``Member.weight_bytes`` (the parameters on
    transformers, the GGUF file llama.cpp maps; absent when unknown) and, for a member on CUDA,
    ``cuda_allocated_mb``: what its load allocated there (``cuda_allocated_bytes()`` after it less
    ``cuda_before``, taken just before it loaded; ``None`` there: nothing was allocated yet)."""
    out = {}
    if member.weight_bytes is not None:
        out["weights_mb"] = _mb(member.weight_bytes)
    if getattr(getattr(member, "device", None), "type", None) == "cuda" and (now := cuda_allocated_bytes()) is not None:
        out["cuda_allocated_mb"] = _mb(now - (cuda_before or 0))
    return out


# ------------------------------------------------------------------ batched streams
def cycled(prompts, n: int) -> list:
    """``n`` prompts: ``prompts`` over and over."""
    return [prompts[i % len(prompts)] for i in range(n)]


def streams_sample(ens: Ensemble, prompts, max_new_tokens: int) -> dict:
    """``prompts`` generated together, greedy, in the loop of ``Ensemble.generate`` on a list (all opened,
    then every unfinished sequence in each ``Ensemble.step``; the same outputs). ``prefill_s``: opening
    and the first step (every prompt's prefill and first piece), ``decode_s``: the steps after it;
    ``pieces``: chosen pieces of all sequences (``Generation.steps`` summed), ``decode_pieces``: those
    after the first step."""
    seqs = []
    t0 = time.perf_counter()
    try:
        for i, p in enumerate(prompts):
            seqs.append(ens.open(p, sampling=Sampling(), max_new_tokens=max_new_tokens, index=i))
        if active := [s for s in seqs if s.finished is None]:
            ens.step(active)
        t1, first = time.perf_counter(), sum(s.steps for s in seqs)
        while active := [s for s in seqs if s.finished is None]:
            ens.step(active)
        t2, pieces = time.perf_counter(), sum(s.steps for s in seqs)
    finally:
        for s in seqs:
            ens.close(s)
    return {"pieces": pieces, "decode_pieces": pieces - first, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "wall_s": t2 - t0, "outputs": [bytes(s.output) for s in seqs]}


def _rate(pieces: int, seconds: float) -> float:
    return round(pieces / seconds, 2) if seconds > 0 else 0.0


def measure_streams(ens: Ensemble, prompts, counts, *, max_new_tokens: int, rounds: int = 1,
                    progress: bool = True) -> dict:
    """Batched streams: for each N in ``counts``, N prompts (``prompts`` cycled) stepped together
    (``streams_sample``) against each prompt generated alone, one at a time.

    Each round generates every distinct prompt alone, then each count's batch; the median round (by
    tokens/s) of each is reported. A row: ``streams`` N, ``pieces``, ``wall_s`` (open to last piece:
    prefill included), ``prefill_s``, ``decode_s``, ``tokens_per_s`` (pieces / wall_s),
    ``decode_tokens_per_s`` (pieces after the first step / decode_s), ``one_by_one_tokens_per_s`` (the
    same N prompts generated one at a time, prefill included, from the alone runs), ``vs_1_stream``
    (tokens_per_s / one_by_one_tokens_per_s), ``identical`` (outputs equal to the prompt's alone
    output, in the worst round) of ``compared`` (N), and ``cuda_peak_mb`` on CUDA (the batch's peak
    allocation, weights included; the process's peak before the section is ``cuda_peak_before_mb``:
    ``cuda_peak_mb`` gives the whole). Greedy decoding, no stop strings."""
    counts = sorted(set(counts))
    distinct = list(prompts[:min(len(prompts), max(counts))])
    before = cuda_peak_bytes()  # the peak so far: each batch below starts a new one
    ens.generate(cycled(distinct, 2), max_new_tokens=4)  # warm-up, batched shapes included
    alone: list[list[dict]] = [[] for _ in distinct]
    together: dict[int, list[dict]] = {n: [] for n in counts}
    peaks: dict[int, int] = {}
    with progress_bar(total=rounds * (len(distinct) + len(counts)), desc="streams", unit="batch",
                      enabled=progress) as bar:
        for _ in range(rounds):
            for i, p in enumerate(distinct):
                alone[i].append(streams_sample(ens, [p], max_new_tokens))
                bar.update(1)
            for n in counts:
                cuda_peak_bytes(reset=True)
                sample = streams_sample(ens, cycled(distinct, n), max_new_tokens)
                if (peak := cuda_peak_bytes()) is not None:
                    peaks[n] = max(peaks.get(n, 0), peak)
                sample["identical"] = sum(out == alone[i % len(distinct)][0]["outputs"][0]
                                          for i, out in enumerate(sample["outputs"]))
                together[n].append(sample)
                bar.update(1)
    one = [_median_sample(runs) for runs in alone]
    rows = []
    for n in counts:
        s = _median_sample(together[n])
        ref = cycled(one, n)
        ref_tps = _rate(sum(r["pieces"] for r in ref), sum(r["wall_s"] for r in ref))
        tps = _rate(s["pieces"], s["wall_s"])
        rows.append({"streams": n, "pieces": s["pieces"], "wall_s": round(s["wall_s"], 3),
                     "prefill_s": round(s["prefill_s"], 3), "decode_s": round(s["decode_s"], 3),
                     "tokens_per_s": tps, "decode_tokens_per_s": _rate(s["decode_pieces"], s["decode_s"]),
                     "one_by_one_tokens_per_s": ref_tps, "vs_1_stream": round(tps / ref_tps, 3) if ref_tps else None,
                     "identical": min(x["identical"] for x in together[n]), "compared": n,
                     **({"cuda_peak_mb": _mb(peaks[n])} if n in peaks else {})})
    return {"prompts": len(distinct), "max_new_tokens": max_new_tokens, "rounds": rounds, "rows": rows,
            **({"cuda_peak_before_mb": _mb(before)} if before is not None else {}),
            "one_by_one": {"pieces": sum(r["pieces"] for r in one), "wall_s": round(sum(r["wall_s"] for r in one), 3),
                           "tokens_per_s": _rate(sum(r["pieces"] for r in one), sum(r["wall_s"] for r in one)),
                           "decode_tokens_per_s": _rate(sum(r["decode_pieces"] for r in one),
                                                        sum(r["decode_s"] for r in one))}}


def _median_sample(samples: list[dict]) -> dict:
    """The round whose tokens/s is the median (the lower of the middle two)."""
    ranked = sorted(samples, key=lambda x: x["pieces"] / max(x["wall_s"], 1e-12))
    return ranked[(len(ranked) - 1) // 2]


def streams_figures(section: dict) -> dict:
    """A streams section's figures by count, the JSON shape of the bench and ``scripts/bench/bench_cuda.py``:
    ``streams`` (tokens/s, prefill included), ``streams_decode`` (decode only), ``streams_vs_1``
    (against one stream at a time) and ``streams_identical`` (outputs equal to alone), keyed ``"N"``."""
    rows = section["rows"]
    return {"streams": {str(r["streams"]): r["tokens_per_s"] for r in rows},
            "streams_decode": {str(r["streams"]): r["decode_tokens_per_s"] for r in rows},
            "streams_vs_1": {str(r["streams"]): r["vs_1_stream"] for r in rows},
            "streams_identical": {str(r["streams"]): r["identical"] for r in rows}}


def print_streams(name: str, section: dict) -> None:
    """The streams section as a table."""
    one, rows = section["one_by_one"], section["rows"]
    cuda = any("cuda_peak_mb" in r for r in rows)
    print(f"\nstreams: {name} (greedy; {section['prompts']} distinct prompts cycled to N; at most "
          f"{section['max_new_tokens']} pieces each; median of {section['rounds']} round(s))")
    print("  tok/s: every piece over the wall time from opening the prompts to the last piece (prefill included); "
          "decode tok/s: the pieces after the first step over the time after it")
    print(f"  1 stream: the same N prompts generated one at a time (over the distinct prompts: "
          f"{one['tokens_per_s']:.2f} tok/s, {one['decode_tokens_per_s']:.2f} decode); identical: outputs equal "
          f"to the prompt's generated alone")
    print(f"{'streams':>7} {'pieces':>7} {'wall s':>8} {'prefill s':>9} {'tok/s':>8} {'decode tok/s':>12} "
          f"{'1 stream tok/s':>14} {'x 1 stream':>10} {'identical':>9}" + (f" {'CUDA peak MiB':>13}" if cuda else ""))
    for r in rows:
        ratio = f"{r['vs_1_stream']:.2f}x" if r["vs_1_stream"] is not None else "-"
        same = f"{r['identical']}/{r['compared']}"
        print(f"{r['streams']:>7} {r['pieces']:>7} {r['wall_s']:>8.2f} {r['prefill_s']:>9.2f} {r['tokens_per_s']:>8.2f} "
              f"{r['decode_tokens_per_s']:>12.2f} {r['one_by_one_tokens_per_s']:>14.2f} {ratio:>10} {same:>9}"
              + (f" {r['cuda_peak_mb']:>13.1f}" if "cuda_peak_mb" in r else ""))
