"""Why ``mux`` (SLM-MUX) won or lost items against the primary member alone: per item the row lost
(or won), each member's majority answer among its first ``k`` samples, how often it was sampled
(its consistency) and whether it is right, and which member ``mux`` chose; at the end, how often
each member was chosen, how often the chosen member's majority was right, and how many items each
member's majority (and ``sc:<primary>``'s) had right.

Usage: python scripts/mux_lost.py RUN TASK [K] (RUN: a `tokenfuse eval --out` directory whose
TASK ran in the generate form with the rows `mux` and `single:<primary>`; K: `mux`'s samples per
member, default 5). Reads the records and `results.json` (the task's primary) only; no model is loaded.
"""
import json
import sys
from collections import Counter
from pathlib import Path

from tokenfuse.eval.answers import sc_pick
from tokenfuse.eval.records import item_file, read_records

run, task_name = Path(sys.argv[1]), sys.argv[2]
k = int(sys.argv[3]) if len(sys.argv) > 3 else 5
load = lambda row: read_records(item_file(run, task_name, "generate", row))
mux = load("mux")
results = json.loads((run / "results.json").read_text())
primary = results["primaries"][task_name]["member"]
samples = {m: load(f"samples:{m}") for m in sorted(results["members"])}
alone = load(f"single:{primary}")


def majority_of(rec: dict) -> tuple[str | None, int, bool]:
    """A member's majority answer among its first k samples, its count, and whether it is right."""
    j, votes = sc_pick(rec["extracted"][:k])
    return (None, 0, False) if votes == 0 else (rec["extracted"][j], votes, rec["correct"][j])


def show(i: str) -> None:
    r = mux[i]
    parts = []
    for m, per in samples.items():
        ans, votes, ok = majority_of(per[i])
        mark = "*" if m == r["chosen"] else " "
        parts.append(f"{mark}{m.split('-')[0]}: {str(ans)[:10]:>10} {votes}/{k} {'right' if ok else 'wrong'}")
    print(f"  {i:>16}  " + " | ".join(parts) + f"  | {primary.split('-')[0]} greedy {alone[i]['extracted']!s}")


ids = list(mux)
lost = [i for i in ids if alone[i]["correct"] and not mux[i]["correct"]]
won = [i for i in ids if mux[i]["correct"] and not alone[i]["correct"]]
print(f"mux on {task_name} (k={k}): {len(ids)} items, {sum(mux[i]['correct'] for i in ids)} right; "
      f"lost {len(lost)} that {primary} greedy got, won {len(won)}")
print("lost:")
for i in lost:
    show(i)
print("won:")
for i in won:
    show(i)
chosen = Counter(mux[i]["chosen"] for i in ids)
right_when = Counter(mux[i]["chosen"] for i in ids if mux[i]["correct"])
print("chosen member: " + ", ".join(f"{m} {chosen[m]} ({right_when[m]} right)" for m in samples))
print("each member's majority of its first k samples right: "
      + ", ".join(f"{m} {sum(majority_of(per[i])[2] for i in ids)}" for m, per in samples.items()))
ties = sum(1 for i in ids if mux[i]["consistency"].count(max(mux[i]["consistency"])) > 1)
print(f"items where the top consistency was tied between members: {ties}")
sc = load(f"sc:{primary}")
if sc:
    print(f"sc:{primary} right: {sum(r['correct'] for r in sc.values())}")
