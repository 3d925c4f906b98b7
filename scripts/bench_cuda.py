"""Figures for a machine with a GPU, where the bundled models' weights are not at hand.

The device machines this project is lent have no network and take at most 64 MiB of files along, so the
bundled GGUF files (800 MB) cannot travel there; their architectures can. This script builds each bundled
member's architecture (its converted ``config.json``) with random weights (seeded) on the bundled model's
real tokenizer, saves it under ``--out/<name>`` (a local directory any tokenfuse member can load), and
prints what does not depend on the weights:

- chunk cost: the median ms of one forward feeding k positions and keeping all k positions' logits
  (``Member.logprobs_at``, what speculative verification pays) against k = 1, per member;
- batched streams: GaC on the three members for N prompts stepped together (``Ensemble.generate`` of a
  list) against the same prompts one by one: tokens/s and whether the outputs are identical.

Random weights make the outputs noise and speculative acceptance meaningless (the members agree on nothing);
ms per forward, the engine's time outside the forwards and the batching figures are the real architectures'.
``tokenfuse bench --models OUT/a,OUT/b,OUT/c --backends transformers`` then times the members and methods.

Usage: TOKENFUSE_CACHE=<cache holding models/<name>/config.json and the tokenizer files>
       python scripts/bench_cuda.py --out /tmp/members [--dtype float32] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from tokenfuse import Ensemble
from tokenfuse.bundled import BUNDLED, DEFAULT_ENSEMBLE
from tokenfuse.config import MemberConfig
from tokenfuse.load import load_member
from tokenfuse.paths import cache_dir

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPTS = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):", "The quick brown fox",
           "Once upon a time", "Translate to French: The weather is nice today.\nFrench:",
           "Q: Tom has 3 apples and buys 5 more. How many apples does he have?\nA:",
           "The three most important inventions of the 20th century are", "import numpy as np\n"]
CHUNK_PROMPT = ("Question: A student measures the mass of a rock, then breaks it into three pieces and measures "
                "each piece. What will the total mass of the pieces be?\nAnswer: the same as the mass of the rock, "
                "because mass is conserved when")


def build(name: str, out: Path, seed: int) -> Path:
    """``out/<name>``: the bundled model's architecture with random weights on its real tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = BUNDLED[name].model_dir(cache_dir())
    dest = out / name
    if (dest / "model.safetensors").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        if (src / f).exists():
            shutil.copy(src / f, dest / f)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
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


def streams(ens: Ensemble, n: int, max_new_tokens: int) -> tuple[float, float, int]:
    """tokens/s for ``n`` prompts together and one by one, and how many outputs are identical."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    t = time.perf_counter()
    together = ens.generate(prompts, max_new_tokens=max_new_tokens)
    t_together = time.perf_counter() - t
    t = time.perf_counter()
    alone = [ens.generate(p, max_new_tokens=max_new_tokens) for p in prompts]
    t_alone = time.perf_counter() - t
    pieces = sum(g.steps for g in together)
    same = sum(a.output == b.output for a, b in zip(together, alone))
    return pieces / t_together, sum(g.steps for g in alone) / t_alone, same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, dtype {a.dtype}", flush=True)
    dirs = [build(name, a.out, seed) for seed, name in enumerate(DEFAULT_ENSEMBLE)]
    members = [load_member(MemberConfig(name=name, source=str(d), backend="transformers", dtype=a.dtype),
                           progress=False) for name, d in zip(DEFAULT_ENSEMBLE, dirs)]
    ks = [int(k) for k in a.ks.split(",")]
    for m in members:
        chunk_cost(m, ks[:2], 3)  # warm-up
        ms = chunk_cost(m, ks, a.repeats)
        print(f"chunk {m.name:30s} " + "  ".join(f"k={k} {ms[k]:6.2f} ms ({ms[k] / ms[ks[0]]:.2f}x)" for k in ks),
              flush=True)
    ens = Ensemble(members)
    ens.generate(PROMPTS[:2], max_new_tokens=4)  # warm-up
    for n in (int(x) for x in a.streams.split(",")):
        together, alone, same = streams(ens, n, a.max_new_tokens)
        print(f"streams gac n={n}: together {together:6.1f} tokens/s, one by one {alone:6.1f} tokens/s "
              f"({together / alone:.2f}x), identical outputs {same}/{n}", flush=True)


if __name__ == "__main__":
    main()
