"""Figures for a machine with a GPU, where the bundled models' weights are not at hand.

The device machines this project is lent have no network and take at most 64 MiB of files along, so the
bundled GGUF files (800 MB) cannot travel there; their architectures can. This script builds each bundled
member's architecture (its converted ``config.json``; where the cache has none, the config read from the
GGUF's metadata) with random weights (seeded) on the bundled model's real tokenizer, saves it under
``--out/<name>`` (a local directory any tokenfuse member can load), and prints what does not depend on the
weights:

- chunk cost: the median ms of one forward feeding k positions and keeping all k positions' logits
  (``Member.logprobs_at``, what speculative verification pays) against k = 1, per member;
- ms per token, decode only (``tokenfuse bench``'s measure), of each member alone and of GaC on the three
  (against the sum of the members alone and the slowest alone);
- each member's weight memory (``Member.weight_bytes``; on CUDA also what its load allocated, and the
  process's peak allocation);
- batched streams (``tokenfuse.bench.streams.measure_streams``, what ``tokenfuse bench --streams`` runs): GaC for
  N prompts stepped together (``Ensemble.generate`` of a list; N = 1, 8, 32 by default) against the same
  prompts one at a time: tokens/s with the prefill and decode only, the ratio, and how many outputs are
  identical.

``--json PATH`` writes the figures in the shape of ``docs/benchmarks/gpu-<card>.json``: ``card``, ``gac``
(``ms_per_token``, ``vs_sum``, ``vs_slowest``), ``streams`` ({"1": tokens/s, "8": ..., "32": ...}, prefill
included) with ``streams_decode``, ``streams_vs_1`` and ``streams_identical`` beside it (and every figure
of each count in ``streams_detail``), and ``members`` (each one's ``ms_per_token``, ``weights_mb``,
``cuda_allocated_mb`` on CUDA, ``chunk_ms``).

Random weights make the outputs noise and speculative acceptance meaningless (the members agree on nothing);
ms per forward, the engine's time outside the forwards and the batching figures are the real architectures'.
``tokenfuse bench --models OUT/a,OUT/b,OUT/c --backends transformers`` then times the members and methods.

Usage: TOKENFUSE_CACHE=<cache holding models/<name>/config.json and the tokenizer files>
       python scripts/bench/bench_cuda.py --out /tmp/members [--dtype float32] [--max-new-tokens 32] [--json gpu.json]
A smoke run on a CPU (architectures cut to 2 layers of width 64, a few figures):
       python scripts/bench/bench_cuda.py --out /tmp/tiny --device cpu --tiny --ks 1,2 --repeats 2 --streams 1,2 \\
           --max-new-tokens 4 --prompts 2 --json /tmp/tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from tokenfuse import Ensemble
from tokenfuse.bench import decode_ms_per_token
from tokenfuse.bench.streams import (cuda_allocated_bytes, cuda_peak_mb, measure_streams, member_memory, print_streams,
                                     streams_figures)
from tokenfuse.bundled import BUNDLED, DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member
from tokenfuse.members.gguf_tokenizer import ensure_tokenizer
from tokenfuse.paths import cache_dir

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPTS = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):", "The quick brown fox",
           "Once upon a time", "Translate to French: The weather is nice today.\nFrench:",
           "Q: Tom has 3 apples and buys 5 more. How many apples does he have?\nA:",
           "The three most important inventions of the 20th century are", "import numpy as np\n"]
CHUNK_PROMPT = ("Question: A student measures the mass of a rock, then breaks it into three pieces and measures "
                "each piece. What will the total mass of the pieces be?\nAnswer: the same as the mass of the rock, "
                "because mass is conserved when")
# --tiny: every architecture cut to this (its vocabulary, tokenizer and kind kept)
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32}


def architecture(name: str, *, tiny: bool):
    """The bundled model's config: the converted ``config.json`` in the cache, else read from the GGUF's
    metadata (no weights); with ``tiny``, cut to ``TINY``."""
    from transformers import AutoConfig

    src = BUNDLED[name].model_dir(cache_dir())
    if (src / "config.json").exists():
        config = AutoConfig.from_pretrained(src)
    else:
        gguf = BUNDLED[name].gguf_path(cache_dir())
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tiny:
        for key, value in TINY.items():
            setattr(config, key, value)
        if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer (Gemma-3)
            config.layer_types = config.layer_types[:TINY["num_hidden_layers"]]
    return config


def build(name: str, out: Path, seed: int, *, tiny: bool = False) -> Path:
    """``out/<name>`` (``<name>-tiny`` with ``tiny``): the bundled model's architecture with random weights
    on its real tokenizer."""
    from transformers import AutoModelForCausalLM

    dest = out / (f"{name}-tiny" if tiny else name)
    if (dest / "model.safetensors").exists():
        return dest
    src = BUNDLED[name].model_dir(cache_dir())
    if not (src / "tokenizer.json").exists():  # no tokenizer files in the cache: build them from the GGUF
        src = ensure_tokenizer(name, progress=False)
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        if (src / f).exists() and f != "config.json":
            shutil.copy(src / f, dest / f)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(architecture(name, tiny=tiny), dtype=torch.float32)
    model.save_pretrained(dest)
    return dest


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def chunk_cost(member, ks: list[int], repeats: int) -> dict[int, float]:
    ids = member.encode_prompt(CHUNK_PROMPT)
    cut = len(ids) - max(ks)
    st = member.new_state(ids[:cut])
    member.next_logprobs([st])
    ms = {}
    for k in ks:
        runs = []
        for _ in range(repeats):
            st.ids, st.n_valid = list(ids[cut:cut + k]), cut
            sync()
            t = time.perf_counter()
            member.logprobs_at(st, list(range(cut + 1, cut + k + 1)))
            sync()
            runs.append(1000 * (time.perf_counter() - t))
        ms[k] = statistics.median(runs)
    member.release(st)
    return ms


def counts(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {text!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where the random-weight members are built (reused)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    ap.add_argument("--device", default="auto", help="the members' device: auto (CUDA when there is one), cuda, cpu")
    ap.add_argument("--batched", action=argparse.BooleanOptionalAction, default=None,
                    help="the transformers members' `batched` option (default: the member's default)")
    ap.add_argument("--tiny", action="store_true", help="architectures cut to 2 layers of width 64 (a smoke run)")
    ap.add_argument("--ks", type=counts, default="1,2,4,8,16", help="chunk sizes of the chunk cost")
    ap.add_argument("--repeats", type=int, default=20, help="forwards per chunk size (median)")
    ap.add_argument("--streams", type=counts, default="1,8,32", help="stream counts of the batched streams")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"prompts for ms/token and the streams (at most {len(PROMPTS)}; cycled to each count)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write the figures here (the shape of docs/benchmarks/gpu-<card>.json)")
    a = ap.parse_args()
    on_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    card = torch.cuda.get_device_name() if on_cuda else "cpu"
    prompts = PROMPTS[:max(1, min(a.prompts, len(PROMPTS)))]
    print(f"device: {card}, dtype {a.dtype}{', tiny architectures' if a.tiny else ''}", flush=True)
    dirs = [build(name, a.out, seed, tiny=a.tiny) for seed, name in enumerate(DEFAULT_ENSEMBLE)]
    members, memory = [], {}
    extra = {} if a.batched is None else {"batched": a.batched}
    for name, d in zip(DEFAULT_ENSEMBLE, dirs):
        before = cuda_allocated_bytes()
        members.append(load_member(MemberConfig(name=name, source=str(d), backend="transformers", device=a.device,
                                                dtype=a.dtype, **extra), progress=False))
        memory[name] = member_memory(members[-1], before)
    figures: dict = {name: {} for name in DEFAULT_ENSEMBLE}
    for m in members:
        chunk_cost(m, a.ks[:2], 3)  # warm-up
        ms = chunk_cost(m, a.ks, a.repeats)
        figures[m.name]["chunk_ms"] = {str(k): round(v, 3) for k, v in ms.items()}
        print(f"chunk {m.name:30s} " + "  ".join(f"k={k} {ms[k]:6.2f} ms ({ms[k] / ms[a.ks[0]]:.2f}x)" for k in a.ks),
              flush=True)
    ens = Ensemble(members)
    alone = {m.name: decode_ms_per_token(Ensemble.single(m), prompts, a.max_new_tokens) for m in members}
    gac = decode_ms_per_token(ens, prompts, a.max_new_tokens)
    for m in members:
        figures[m.name] |= {"ms_per_token": round(alone[m.name], 2), **memory[m.name]}
        print(f"alone {m.name:30s} {alone[m.name]:7.2f} ms/token  memory (MiB) {json.dumps(memory[m.name])}",
              flush=True)
    gac_figures = {"ms_per_token": round(gac, 2), "vs_sum": round(gac / sum(alone.values()), 3),
                   "vs_slowest": round(gac / max(alone.values()), 3)}
    print(f"gac {gac:.2f} ms/token: {gac_figures['vs_sum']:.3f}x the sum of the members alone, "
          f"{gac_figures['vs_slowest']:.3f}x the slowest (decode only, median over {len(prompts)} prompts)", flush=True)
    section = measure_streams(ens, prompts, a.streams, max_new_tokens=a.max_new_tokens, progress=False)
    print_streams("gac on the three", section)
    peak = cuda_peak_mb(section)
    if peak is not None:
        print(f"CUDA peak allocated: {peak} MiB", flush=True)
    if a.json:
        result = {"card": card, "device": "cuda" if on_cuda else "cpu", "dtype": a.dtype, "tiny": a.tiny,
                  "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                  "cpus": os.cpu_count(), "max_new_tokens": a.max_new_tokens, "prompts": len(prompts),
                  "gac": gac_figures, **streams_figures(section), "streams_detail": section, "members": figures,
                  **({"cuda_max_allocated_mb": peak} if peak is not None else {})}
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"figures: {a.json}", flush=True)


if __name__ == "__main__":
    main()
