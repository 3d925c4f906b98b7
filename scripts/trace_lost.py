"""Per-step traces of a few items a row lost where the expert (the task's primary) alone was right:
at each step where the row's piece differs from the expert's own top piece, print both, the
expert's probability of each, and the row's terms.

Usage: TOKENFUSE_DATA=DIR python scripts/trace_lost.py RUN TASK ROW N (RUN: a
`tokenfuse eval --out` directory of the three bundled members; ROW: an engine row of TASK in the
generate form). The regenerated output is checked against the record ("same output as the record").
At the end, over the traced items: how many steps the row ensembled, how many of those left the
expert's top piece, and how many of these chose a strict byte prefix of it (e.g. `' '` for `' is'`:
SAFE's sharpening gives a prefix its extensions' mass).
"""
import json
import os
import sys
from pathlib import Path

from tokenfuse.config import config_from_models
from tokenfuse.load import load_ensemble
from tokenfuse.tasks import load_task, prompt_form

run, task_name, row, n = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
items_dir = run / "items" / f"{task_name}-generate"
spec = json.loads((items_dir / f"{row}.spec.json").read_text())
primary = spec["overrides"]["primary"]
load = lambda f: {json.loads(l)["id"]: json.loads(l) for l in open(items_dir / f)}
mine, alone = load(f"{row}.jsonl"), load(f"single__{primary}.jsonl")
lost = [i for i in mine if alone[i]["correct"] and not mine[i]["correct"]]
won = [i for i in mine if mine[i]["correct"] and not alone[i]["correct"]]
print(f"{row} on {task_name}: {len(mine)} items, lost {len(lost)} that {primary} alone got, won {len(won)}")
task = load_task(task_name, os.environ.get("TOKENFUSE_DATA"))
by_id = {str(it["id"]): it for it in task.items}
cfg = config_from_models("smollm2-135m-instruct,gemma3-270m,qwen2.5-coder-0.5b-instruct")
base = load_ensemble(cfg, progress=False)
variant = cfg.with_overrides(**spec["overrides"])
ens = base.variant(variant.options)
chat = prompt_form(ens.members)
ensembled = left = prefix = 0
for i in lost[:n]:
    it = by_id[i]
    g = ens.generate(task.prompt(it, chat=chat), max_new_tokens=192, stop=task.stop(chat=chat), chat=chat, trace=True)
    print(f"\n== {i}: gold {it['answer']}; {row} extracted {mine[i]['extracted']!r}, {primary} alone {alone[i]['extracted']!r}")
    print(f"   same output as the record: {g.text == mine[i]['output']}")
    shown = 0
    for st in g.trace:
        d = st.to_dict()
        exp = next(m for m in d["members"] if m["name"] == primary)
        if not exp["computed"] or not exp["top"]:
            continue
        etop = exp["top"][0]
        ensembled += d["ensembled"]
        if d["ensembled"] and etop["bytes"] != d["bytes"]:
            left += 1
            prefix += etop["bytes"].startswith(d["bytes"])  # hex of bytes: a byte prefix is a hex prefix
        if etop["bytes"] != d["bytes"] and shown < 6:
            shown += 1
            so_far = "".join(s.text for s in g.trace[:d["step"]])[-60:]
            print(f"   step {d['step']}: ...{so_far!r} -> row {d['token']!r} (expert p {exp['piece_prob']}) "
                  f"vs expert top {etop['text']!r} p {etop['prob']:.3f}; terms {d.get('terms')}")
print(f"\n{min(n, len(lost))} items: {ensembled} steps ensembled, {left} of them left the expert's top piece, "
      f"{prefix} of these chose a strict byte prefix of it")
