"""``tokenfuse bench``: every configuration in one process, interleaved, medians per token.

Rows, for each backend asked for (llama.cpp and transformers by default): each member alone; each
method asked for (``gac,unite`` by default; ``--methods gac,unite,contrast`` adds ``contrast``)
every step with agreement skip (the default for greedy decoding) and, where that skip is exact and
so on by default, without it (``-noskip``; not for ``deepen``, nor ``contrast`` with β > 0, which
skip nothing by default); GaC with the members one after another instead of in threads; GaC
recording the step trace (``gac-trace``: its cost against the ``gac`` row, which records nothing);
speculative GaC (``gac-speculative-kK`` for each ``K`` in ``speculative``: the default drafter, its
acceptance and how many outputs equal the ``gac`` row's); and GaC thresholded at each ``t`` with the
first member as gate. The prompt set is fixed; one warm-up generation per row runs first. Each round
runs every row on every prompt before the next round, so machine drift hits all rows alike. ms/token
counts decode only: wall time from the first chosen piece (prompt prefill done) to the last, divided
by the pieces after the first; stages likewise. ``ensembled_share`` is over all steps of the
generation; ``skip_share`` is the share of ensembled steps decided by agreement skip.

The load section: each member's warm load time and weight memory (``member_memory``), each bundled
model's tokenizer built fresh from its GGUF and loaded from the cache (``tokenizer_times``; with
``compare_transformers`` also the transformers conversion it replaced), the alignment build cold and
cached, and the warm start.

With ``streams`` (``--streams 1,8,32``), the streams section (``measure_streams``): for each count N,
N prompts (the prompt set cycled) stepped together, as ``Ensemble.generate`` steps a list of prompts
(every member gets the rows of all unfinished sequences in one ``next_logprobs`` call), against the
same prompts generated one at a time: tokens/s with the prefill and decode-only, the ratio, and how
many of the N outputs equal the prompt's output generated alone (``tokenfuse.bench.streams``). Without
it nothing of this runs.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenfuse.bench.streams import (cuda_allocated_bytes, cuda_peak_mb, measure_streams, member_memory, print_streams,
                                     streams_figures)
from tokenfuse.config import EnsembleConfig
from tokenfuse.engine import Ensemble
from tokenfuse.engine.timer import STAGES
from tokenfuse.engine.sampling import Sampling
from tokenfuse.engine.trace import TraceOptions
from tokenfuse.progress import progress_bar

PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "Write a Python function that returns the factorial of n.\n",
    "The three most important inventions of the 20th century are",
    "Q: Tom has 3 apples and buys 5 more. How many apples does he have?\nA:",
    "Translate to French: The weather is nice today.\nFrench:",
    "Once upon a time, in a small village by the sea,",
]
STAGE_KEYS = (*STAGES, "other")


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def _decode_sample(ens: Ensemble, prompt: str, max_new_tokens: int, trace: TraceOptions | None = None) -> dict | None:
    """Per-token figures of one generation, decode only: from the first chosen piece (the prompt
    prefill is behind it) to the last. ``None`` if fewer than two pieces were generated."""
    s = ens.open(prompt, sampling=Sampling(), max_new_tokens=max_new_tokens, trace=trace)
    try:
        ens.step([s])
        t0, before = time.perf_counter(), ens.timer.snapshot()
        n = 0
        while s.finished is None:
            n += sum(1 for ev in ens.step([s]) if ev.piece)
        wall = time.perf_counter() - t0
    finally:
        ens.close(s)
    if n == 0:
        return None
    stages = {k: 1000 * v / n for k, v in ens.timer.since(before, wall).items() if k in STAGE_KEYS}
    return {"ms": 1000 * wall / n, "steps": s.steps, "ens": s.counts.ensembled, "skip": s.counts.skipped,
            "drafted": s.counts.drafted, "accepted": s.counts.accepted, "output": bytes(s.output), **stages}


def decode_ms_per_token(ens: Ensemble, prompts, max_new_tokens: int, *, rounds: int = 1) -> float:
    """The bench rows' measure for one ensemble alone: the median decode ms per token over ``prompts``,
    ``rounds`` times each, after one warm-up generation (NaN if no generation had two pieces)."""
    ens.generate(prompts[0], max_new_tokens=4)
    ms = [x["ms"] for _ in range(rounds) for p in prompts if (x := _decode_sample(ens, p, max_new_tokens)) is not None]
    return statistics.median(ms) if ms else float("nan")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _with_backend(cfg: EnsembleConfig, backend: str) -> EnsembleConfig:
    data = cfg.model_dump()
    for m in data["members"]:
        m["backend"] = backend
    return EnsembleConfig.model_validate(data)


def warm_start_seconds(cfg: EnsembleConfig, *, runs: int = 2) -> float:
    """Process start to first token of ``tokenfuse generate`` (the last of ``runs`` runs)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(cfg.to_yaml())
    cmd = [sys.executable, "-m", "tokenfuse.cli", "generate", "Hello", "--config", f.name,
           "--max-new-tokens", "1", "--quiet"]
    seconds = 0.0
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        seconds = time.perf_counter() - t0
    Path(f.name).unlink()
    return seconds


def _union_times(members, align: Path) -> dict:
    """Alignment build: cold (byte tables from the tokenizers + union) and from the disk cache."""
    from tokenfuse.alignment.union import build_union
    from tokenfuse.members.codec import ByteCodec, load_codec_tables

    t0 = time.perf_counter()
    codecs = [ByteCodec(m.tokenizer, vocab_size=m.codec.vocab_size, extra_end_ids=m.codec.end_ids,
                        extra_special_ids=m.codec.special_ids) for m in members]
    build_union(codecs, cache=None)
    cold = time.perf_counter() - t0
    build_union([m.codec for m in members], cache=align)  # make sure the union's cache file exists
    t0 = time.perf_counter()
    cached = [ByteCodec(m.tokenizer, tables=load_codec_tables(m.codec.cache_path)) for m in members]
    build_union(cached, cache=align)
    return {"cold_s": round(cold, 3), "cached_s": round(time.perf_counter() - t0, 3)}


def tokenizer_times(names, *, root: Path, compare_transformers: bool = False) -> dict[str, dict]:
    """Per bundled model in ``names``: its tokenizer built fresh from the GGUF into an empty directory
    (``fresh_s``, what a first run pays), loaded from the cache (``warm_s``: ``FastTokenizer`` of
    ``ensure_tokenizer``) and, with ``compare_transformers`` (about a minute for the three), the
    transformers conversion it replaced (``transformers_s``)."""
    from tokenfuse.bundled import BUNDLED, convert_tokenizer_with_transformers
    from tokenfuse.logs import route_transformers_logs
    from tokenfuse.members.fasttok import FastTokenizer
    from tokenfuse.members.gguf_tokenizer import ensure_tokenizer, write_tokenizer

    times: dict[str, dict] = {}
    for name in dict.fromkeys(n for n in names if n in BUNDLED):
        gguf = BUNDLED[name].gguf_path(root)
        entry = {}
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            write_tokenizer(gguf, tmp)
            entry["fresh_s"] = round(time.perf_counter() - t0, 3)
        ensure_tokenizer(name, root=root, progress=False)  # cached, so the next load is a warm one
        t0 = time.perf_counter()
        FastTokenizer(ensure_tokenizer(name, root=root))
        entry["warm_s"] = round(time.perf_counter() - t0, 3)
        if compare_transformers:
            route_transformers_logs()
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                convert_tokenizer_with_transformers(gguf, Path(tmp))
                entry["transformers_s"] = round(time.perf_counter() - t0, 3)
        times[name] = entry
    return times


def run_bench(cfg: EnsembleConfig, *, backends=("llamacpp", "transformers"), max_new_tokens: int = 32,
              repeats: int = 3, thresholds=(0.3, 0.5, 0.7), quick: bool = False, json_path: str | None = None,
              plot_path: str | None = None, methods=("gac", "unite"), compare_transformers: bool = False,
              speculative=(4,), streams=()) -> dict:
    """The bench (the module's docstring says what it measures); ``streams``: the stream counts of
    the streams section (``measure_streams``, on each backend's ensemble as configured; with
    ``quick``, the first backend's only), none by default."""
    from tokenfuse.paths import cache_dir

    root = cache_dir(cfg.cache_dir)
    align = root / "alignment"
    prompts = PROMPTS[:2] if quick else PROMPTS
    max_new_tokens = min(max_new_tokens, 16) if quick else max_new_tokens
    rows: list[dict] = []
    loads: dict[str, dict] = {}
    union_times: dict[str, dict] = {}
    stream_targets: list[tuple[str, Ensemble]] = []  # (name, ensemble) of each streams section
    tokenizers = tokenizer_times([m.resolved_source for m in cfg.members], root=root,
                                 compare_transformers=compare_transformers)
    for backend in backends:
        bcfg = _with_backend(cfg, backend)
        members = _load_members(bcfg, backend, root, loads)
        union_times[backend] = _union_times(members, align)
        for m in members:
            rows.append({"name": f"{backend}:{m.name}", "backend": backend,
                         "ens": Ensemble.single(m, align_cache=align)})
        this_one = not (quick and backend != backends[0])
        if len(members) > 1 and this_one:
            base = _ensemble_rows(bcfg, backend, members, rows, methods=methods, speculative=speculative,
                                  thresholds=thresholds)
            if streams:  # the ensemble as configured (--method, --gate ...)
                stream_targets.append((f"{backend}:{_label(bcfg)}", base.variant(bcfg.options)))
        elif streams and len(members) == 1 and this_one:
            stream_targets.append((rows[-1]["name"], rows[-1]["ens"]))

    _decode_rows(rows, prompts, repeats=repeats, max_new_tokens=max_new_tokens)
    sections = [{"config": name, **measure_streams(ens, prompts, streams, max_new_tokens=max_new_tokens,
                                                   rounds=repeats)} for name, ens in stream_targets]

    table = [_table_row(r) for r in rows]
    _add_floors(table)
    _add_identical(table, rows)
    result = {"rows": table, "loads": loads, "tokenizers": tokenizers, "union": union_times,
              "union_size": max(len(r["ens"].union) for r in rows),
              "max_new_tokens": max_new_tokens, "repeats": repeats, "prompts": len(prompts),
              "warm_start_s": round(warm_start_seconds(_with_backend(cfg, backends[0])), 2)}
    if (peak := cuda_peak_mb(*sections)) is not None:
        result["cuda_max_allocated_mb"] = peak
    if sections:  # the first section's figures by count; every section in streams_detail
        result |= {"streams_config": sections[0]["config"], **streams_figures(sections[0]),
                   "streams_detail": sections}
    _print(result)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if plot_path:
        plot(result, plot_path)
    return result


def _load_members(bcfg: EnsembleConfig, backend: str, root: Path, loads: dict[str, dict]) -> list:
    """The config's members on ``backend``, one after another, each load's time and memory in
    ``loads`` (a self-ensemble's copy on the model loaded for the first)."""
    from tokenfuse.bundled import BUNDLED, MARK_MODEL
    from tokenfuse.placement.local import load_member, share_member, shared_with

    members = []
    firsts = shared_with(bcfg.members)
    for i, mc in enumerate(bcfg.members):
        t0, cuda_before = time.perf_counter(), cuda_allocated_bytes()
        if firsts[i] == i:
            m = load_member(mc, root=root, index=i)
        else:
            m = share_member(members[firsts[i]], mc, root=root, index=i)
        entry = {"warm_load_s": round(time.perf_counter() - t0, 3), **member_memory(m, cuda_before)}
        if firsts[i] != i:
            entry["shares_weights_of"] = members[firsts[i]].name
        src = mc.resolved_source
        if backend == "transformers" and src in BUNDLED:
            mark = BUNDLED[src].model_dir(root) / MARK_MODEL
            if mark.exists():  # recorded when the GGUF was first converted
                entry["cold_convert_s"] = json.loads(mark.read_text())["seconds"]
        loads[f"{backend}:{mc.name}"] = entry
        members.append(m)
    return members


def _ensemble_rows(bcfg: EnsembleConfig, backend: str, members: list, rows: list[dict], *, methods, speculative,
                   thresholds) -> Ensemble:
    """Append the ensemble rows of one backend to ``rows``; returns the ensemble they are variants of
    (every step ensembled, one union)."""
    from tokenfuse.load import ensemble_from_members

    every_step = bcfg.with_overrides(gate=None, threshold=None, agreement_skip=None, origin="bench")
    base = ensemble_from_members(every_step, members)

    def add(name: str, *, parallel: bool = True, trace: bool = False, **options) -> None:
        """A row: the config with ``options`` (``EnsembleConfig.with_overrides``) on the loaded
        members (``Ensemble.variant``); ``trace``: its generations record the step trace (what
        it costs when on)."""
        variant = every_step.with_overrides(**options, origin=f"bench row {name}")
        ens = base.variant(variant.options.replace(parallel=parallel))  # gac-sequential: one after another
        rows.append({"name": f"{backend}:{name}", "backend": backend, "ens": ens,
                     "trace": TraceOptions() if trace else None})

    for method in methods:
        add(method, method=method)
        if rows[-1]["ens"].combiner.exact_agreement:  # else skip is off by default: the same row again
            add(f"{method}-noskip", method=method, agreement_skip=False)
    add("gac-sequential", method="gac", parallel=False)
    add("gac-trace", method="gac", trace=True)
    for k in speculative:
        add(f"gac-speculative-k{k}", method="gac", speculative={"k": k})
    for t in thresholds:
        add(f"gac-t{t}", method="gac", gate=members[0].name, threshold=t)
    return base


def _decode_rows(rows: list[dict], prompts, *, repeats: int, max_new_tokens: int) -> None:
    """Every row on every prompt, ``repeats`` rounds after a warm-up; each row's decode samples in
    ``row["samples"]`` and the process's memory after its last one in ``row["rss"]``."""
    for r in rows:  # warm-up
        r["ens"].generate(prompts[0], max_new_tokens=4)
        r["samples"] = []
    with progress_bar(total=repeats * len(prompts) * len(rows), desc="bench", unit="generation") as bar:
        for _ in range(repeats):
            for p in prompts:
                for r in rows:
                    if (sample := _decode_sample(r["ens"], p, max_new_tokens, r.get("trace"))) is not None:
                        r["samples"].append(sample)
                    r["rss"] = _rss_mb()
                    bar.update(1)


def _label(cfg: EnsembleConfig) -> str:
    """The method of a config, with its gate and threshold when it has them: ``gac``, ``gac-t0.5``."""
    o = cfg.options
    return o.method + (f"-t{o.threshold}" if o.gate is not None and o.threshold is not None else "")


def _table_row(r: dict) -> dict:
    """One row of the bench table: what the ensemble is (``Ensemble.describe``) and its figures."""
    s, ens = r["samples"], r["ens"]
    desc = ens.describe()
    ms = [x["ms"] for x in s]
    steps = sum(x["steps"] for x in s)
    stage = {k: round(statistics.median(x[k] for x in s), 3) for k in STAGE_KEYS}
    outside = sum(stage[k] for k in STAGE_KEYS if k != "forward")
    return {
        "name": r["name"],
        "members": [m.name for m in ens.members],
        "backend": r["backend"],
        "parallel": desc["parallel"],
        "gate": desc["gate"],
        "threshold": desc["threshold"],
        "trace": r.get("trace") is not None,
        "ms_per_token": round(statistics.median(ms), 2),
        "ms_per_token_p90": round(_p90(ms), 2),
        "tokens_per_s": round(1000 / statistics.median(ms), 2),
        "stage_ms": stage,
        "outside_forward_share": round(outside / max(stage["forward"], 1e-9), 4),
        "ensembled_share": round(sum(x["ens"] for x in s) / max(steps, 1), 4),
        "skip_share": round(sum(x["skip"] for x in s) / max(sum(x["ens"] for x in s), 1), 4),
        "method": desc["method"],
        "agreement_skip": desc["agreement_skip"],
        "steps": steps,
        "peak_rss_mb": round(r["rss"], 1),
        **_speculative_figures(ens, s),
    }


def _speculative_figures(ens: Ensemble, samples: list[dict]) -> dict:
    """A speculative row's drafter, pieces drafted and the share of them the ensemble chose."""
    spec = ens.describe()["speculative"]
    if spec is None:
        return {}
    drafted = sum(x["drafted"] for x in samples)
    return {"draft": spec["draft"], "draft_k": spec["k"],
            "drafted": drafted, "acceptance": round(sum(x["accepted"] for x in samples) / max(drafted, 1), 4)}


def _add_identical(table: list[dict], rows: list[dict]) -> None:
    """A speculative row's outputs against its backend's ``gac`` row, generation by generation:
    ``identical``, the number that are byte-identical, of ``compared``."""
    outputs = {r["name"]: [x["output"] for x in r["samples"]] for r in rows}
    for t in table:
        plain = outputs.get(f"{t['backend']}:gac")
        if "draft" in t and plain is not None:
            mine = outputs[t["name"]]
            t["identical"], t["compared"] = sum(a == b for a, b in zip(mine, plain)), min(len(mine), len(plain))


def _add_floors(table: list[dict]) -> None:
    """Thresholded rows' floor: the gate alone on gated steps, an every-step step of the same method
    (its row) on the others, ``floor_ms_per_token = (1 - e) * gate + e * every_step`` for ensembled share ``e``."""
    by_name = {r["name"]: r for r in table}
    for r in table:
        every = by_name.get(f"{r['backend']}:{r['method']}")
        gate = by_name.get(f"{r['backend']}:{r['gate']}")
        if r["gate"] and every and gate:
            e = r["ensembled_share"]
            r["floor_ms_per_token"] = round((1 - e) * gate["ms_per_token"] + e * every["ms_per_token"], 2)


def _print(result: dict) -> None:
    rows = result["rows"]
    singles = {r["name"]: r["ms_per_token"] for r in rows if len(r["members"]) == 1}
    print(f"\n{'config':48} {'ms/tok':>8} {'p90':>8} {'tok/s':>7} {'fwd':>8} {'outside':>8} {'ens%':>6} {'skip%':>6}  ratio")
    for r in rows:
        b = r["backend"]
        ref = ""
        if r["gate"]:
            gate_ms = singles[b + ":" + r["gate"]]
            ref = f"{r['ms_per_token'] / gate_ms:.3f}x gate alone"
            if "floor_ms_per_token" in r:
                ref += f"; floor {r['floor_ms_per_token']:.2f} ms ({r['ms_per_token'] / r['floor_ms_per_token']:.3f}x)"
        elif len(r["members"]) > 1:
            alone = [singles[b + ":" + m] for m in r["members"]]
            ref = f"{r['ms_per_token'] / sum(alone):.3f}x sum of members, {r['ms_per_token'] / max(alone):.3f}x slowest"
            if "draft" in r:
                ref += (f"; draft {r['draft']}, {100 * r['acceptance']:.0f}% accepted"
                        + (f", {r['identical']}/{r['compared']} outputs = gac" if "identical" in r else ""))
        elif b != "transformers" and "transformers:" + r["members"][0] in singles:
            speedup = singles["transformers:" + r["members"][0]] / r["ms_per_token"]
            ref = f"{speedup:.2f}x faster than transformers"
        print(f"{r['name']:48} {r['ms_per_token']:8.2f} {r['ms_per_token_p90']:8.2f} {r['tokens_per_s']:7.2f} "
              f"{r['stage_ms']['forward']:8.2f} {100 * r['outside_forward_share']:7.2f}% "
              f"{100 * r['ensembled_share']:5.1f}% {100 * r['skip_share']:5.1f}%  {ref}")
    for section in result.get("streams_detail", []):
        print_streams(section["config"], section)
    print("\nloads (s):", json.dumps({k: {n: v for n, v in e.items() if n.endswith("_s")}
                                      for k, e in result["loads"].items()}))
    print("member memory (MiB; weights: Member.weight_bytes, cuda: allocated by its load):", json.dumps(
        {k: {n: v for n, v in e.items() if not n.endswith("_s")} for k, e in result["loads"].items()}))
    print("tokenizer builds (s):", json.dumps(result["tokenizers"]))
    print(f"union: {result['union_size']} entries; build (s): {json.dumps(result['union'])}")
    print(f"warm start, process start to first token: {result['warm_start_s']} s; "
          f"peak RSS {max(r['peak_rss_mb'] for r in rows)} MB"
          + (f", CUDA peak allocated {result['cuda_max_allocated_mb']} MiB" if "cuda_max_allocated_mb" in result else ""))


def plot(result: dict, path: str) -> None:
    """Stacked bars of per-token stage times, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 5))
    bottom = [0.0] * len(rows)
    for k in STAGE_KEYS:
        vals = [r["stage_ms"][k] for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("ms per generated token (median stages)")
    ax.set_title("tokenfuse bench")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
