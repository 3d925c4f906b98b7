"""Benchmark tasks: prompts and scoring in one place per task, for ``tokenfuse select`` and ``tokenfuse eval``.

Data is the benchmark JSONL of ``shared/benchmarks/README.md`` (``<benchmark>/<split>.jsonl``), read
from the directory given as ``data_dir`` (``--data``), else ``$TOKENFUSE_DATA``.

    task = load_task("arc_challenge", data_dir)
    for item in task.subset(50, seed=1234):
        prompt = task.prompt(item, chat=True)          # str (raw) or list of chat messages
        text = ensemble.generate(prompt, chat=True, stop=task.stop(chat=True),
                                 max_new_tokens=task.max_new_tokens).text
        task.score(item, text).correct
    task.cloze(item)   # multiple choice only: context + continuations for likelihood scoring

| task | module | shots | answer | dev pool (``Task.dev_pool``, ``dev_items``) |
|---|---|---|---|---|
| gsm8k | ``gsm8k`` | 5 from train, CoT | last number | ``gsm8k/train.jsonl`` less the shots |
| mmlu | ``mmlu`` | the subject's 5 dev items | generated letter | ``mmlu/dev.jsonl`` + hash split of test |
| arc_challenge, arc_easy | ``arc`` | 0 | generated letter | ``arc/*_dev.jsonl`` |
| piqa | ``piqa`` | 0 | generated letter | hash split |
| boolq | ``boolq`` | 0 | generated yes/no | hash split |
| triviaqa | ``qa`` | 5 | normalised exact match, any alias | ``triviaqa/dev.jsonl`` less the shots |
| nq_open | ``qa`` | 5 | normalised exact match, any alias | hash split |
| bbh | ``bbh`` | the official 3 CoT exemplars | exact match after "the answer is" | hash split |

The hash split (``base.is_dev``) sets about one item in ten aside and removes it from ``items``
(GSM8K's too, though its pool is the train file, so its test items are what they were before), so
reported items never include a dev item. A dev file missing from the data directory: the hash
split instead, said on standard error. No dev item is its own few-shot exemplar (each module says how).

Each module's docstring gives its exact templates; ``base`` documents how prompts are assembled;
``run`` holds the prompt-form rule and "generate a batch, then grade" (``generate_graded``).
"""

from __future__ import annotations

import os
from difflib import get_close_matches

from tokenfuse.tasks.arc import ARCChallenge, ARCEasy
from tokenfuse.tasks.base import (DATA_ENV, DEFAULT_SEED, ClozeItem, Item, Score, Task, TaskDataError,
                                  resolve_data_dir, subset)
from tokenfuse.tasks.bbh import BBH
from tokenfuse.tasks.boolq import BoolQ
from tokenfuse.tasks.gsm8k import GSM8K
from tokenfuse.tasks.mmlu import MMLU
from tokenfuse.tasks.piqa import PIQA
from tokenfuse.tasks.qa import NQOpen, TriviaQA
from tokenfuse.tasks.run import PROMPT_FORMS, Graded, generate_graded, prompt_form, uses_chat

TASKS: dict[str, type[Task]] = {
    t.name: t for t in (GSM8K, MMLU, ARCChallenge, ARCEasy, PIQA, BoolQ, TriviaQA, NQOpen, BBH)
}


def load_task(name: str, data_dir: str | os.PathLike | None = None, *, num_fewshot: int | None = None,
              fewshot_seed: int = DEFAULT_SEED) -> Task:
    """Build task ``name`` on the benchmark files under ``data_dir`` (else ``$TOKENFUSE_DATA``).

    ``num_fewshot`` overrides the task's default number of shots.
    """
    if name not in TASKS:
        hint = get_close_matches(name, TASKS, n=1)
        raise TaskDataError(f"unknown task {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                            + f" (tasks: {', '.join(TASKS)})")
    return TASKS[name](data_dir, num_fewshot=num_fewshot, fewshot_seed=fewshot_seed)


__all__ = ["TASKS", "DATA_ENV", "DEFAULT_SEED", "PROMPT_FORMS", "ClozeItem", "Graded", "Item", "Score", "Task",
           "TaskDataError", "generate_graded", "load_task", "prompt_form", "resolve_data_dir", "subset", "uses_chat"]
