"""``tokenfuse bench --streams``: the flag, the streams measurement on tiny random-weight members (the
counts, the pieces, outputs identical to each prompt alone, one ``next_logprobs`` call for all rows)
and the section in the bench's output and JSON; members' weight memory in the bench and in
``tokenfuse models``. Exact figures only, never timings."""

from __future__ import annotations

import json

import pytest

import tokenfuse.bench
import tokenfuse.placement.local
from tokenfuse.bench import PROMPTS
from tokenfuse.bench.streams import cycled, measure_streams, member_memory, streams_figures, streams_sample
from tokenfuse.bundled import BUNDLED, DEFAULT_ENSEMBLE, MARK_MODEL
from tokenfuse.cli import main
from tokenfuse.engine import Ensemble
from tokenfuse.paths import cache_dir

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILY_SEED = {"smollm2": 0, "qwen": 1}


@pytest.fixture(scope="module")
def tiny_members(make_tiny):
    return {family: make_tiny(family, seed=seed, name=family) for family, seed in FAMILY_SEED.items()}


@pytest.fixture(scope="module")
def ens(tiny_members, align_cache):
    return Ensemble(list(tiny_members.values()), align_cache=align_cache)


# ---------------------------------------------------------------------------------------- the flag
def test_streams_flag_reaches_the_bench_and_is_off_by_default(monkeypatch):
    seen = []
    monkeypatch.setattr(tokenfuse.bench, "run_bench", lambda cfg, **kw: seen.append(kw))
    assert main(["bench", "--models", "smollm2", "--streams", "32,1,8,8"]) == 0
    assert main(["bench", "--models", "smollm2", "--streams", " 4 "]) == 0
    assert main(["bench", "--models", "smollm2"]) == 0
    assert [kw["streams"] for kw in seen] == [(1, 8, 32), (4,), ()]


# ---------------------------------------------------------------------------------------- the measurement
def test_streams_rows_are_exact_on_tiny_members(ens):
    prompts, counts, n_new = PROMPTS[:4], (8, 1, 3), 5
    section = measure_streams(ens, prompts, counts, max_new_tokens=n_new, rounds=2, progress=False)
    rows = section["rows"]
    assert [r["streams"] for r in rows] == [1, 3, 8]
    assert (section["prompts"], section["rounds"], section["max_new_tokens"]) == (4, 2, n_new)
    for r in rows:
        together = ens.generate(cycled(prompts, r["streams"]), max_new_tokens=n_new)
        assert r["pieces"] == sum(g.steps for g in together)
        assert r["identical"] == r["compared"] == r["streams"]  # greedy: each stream's output is its prompt's alone
        assert r["wall_s"] >= r["decode_s"] >= 0 and r["prefill_s"] > 0
        assert r["tokens_per_s"] > 0 and r["one_by_one_tokens_per_s"] > 0 and r["vs_1_stream"] > 0
        assert "cuda_peak_mb" not in r  # CPU
    alone = [ens.generate(p, max_new_tokens=n_new) for p in prompts]
    assert section["one_by_one"]["pieces"] == sum(g.steps for g in alone)

    figures = streams_figures(section)
    assert set(figures) == {"streams", "streams_decode", "streams_vs_1", "streams_identical"}
    assert all(list(d) == ["1", "3", "8"] for d in figures.values())
    assert figures["streams_identical"] == {"1": 1, "3": 3, "8": 8}
    assert figures["streams"] == {str(r["streams"]): r["tokens_per_s"] for r in rows}


def test_streams_are_stepped_together_in_one_call_per_member(ens, monkeypatch):
    prompts = cycled(PROMPTS, 8)
    rows: dict[str, list[int]] = {m.name: [] for m in ens.members}
    for m in ens.members:
        real = m.next_logprobs

        def counted(states, _real=real, _name=m.name):
            rows[_name].append(len(states))
            return _real(states)

        monkeypatch.setattr(m, "next_logprobs", counted)
    sample = streams_sample(ens, prompts, 6)
    monkeypatch.undo()
    assert all(calls[0] == 8 and max(calls) == 8 for calls in rows.values()), rows  # the first step: all 8 rows
    assert sample["outputs"] == [g.output for g in ens.generate(prompts, max_new_tokens=6)]  # generate's loop
    assert sample["pieces"] - sample["decode_pieces"] == 8 - sum(not out for out in sample["outputs"])


# ---------------------------------------------------------------------------------------- the bench
def test_bench_streams_section_and_memory(capsys, monkeypatch, tmp_path, tiny_members):
    monkeypatch.setenv("TOKENFUSE_CACHE", str(tmp_path))
    monkeypatch.setattr(tokenfuse.placement.local, "load_member", lambda mc, **kw: tiny_members[mc.name])
    monkeypatch.setattr(tokenfuse.bench, "warm_start_seconds", lambda cfg: 0.0)  # no subprocess on real models
    path = tmp_path / "bench.json"
    code = main(["bench", "--backends", "transformers", "--models", "smollm2,qwen", "--quick", "--methods", "gac",
                 "--speculative-k", "none", "--thresholds", "0.5", "--max-new-tokens", "4", "--streams", "3,1",
                 "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(path.read_text())
    assert data["streams_config"] == "transformers:gac"
    assert list(data["streams"]) == list(data["streams_decode"]) == ["1", "3"]
    assert data["streams_identical"] == {"1": 1, "3": 3}
    (section,) = data["streams_detail"]
    assert [(r["streams"], r["compared"]) for r in section["rows"]] == [(1, 1), (3, 3)]
    assert (section["prompts"], section["max_new_tokens"], section["rounds"]) == (2, 4, 1)  # --quick: 2 prompts
    for family, m in tiny_members.items():
        assert data["loads"][f"transformers:{family}"]["weights_mb"] == round(m.weight_bytes / 2**20, 1)
        assert data["loads"][f"transformers:{family}"] == member_memory(m) | {
            "warm_load_s": data["loads"][f"transformers:{family}"]["warm_load_s"]}
    assert "cuda_max_allocated_mb" not in data
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("streams: transformers:gac"))
    table = next(i for i in range(head, len(lines)) if lines[i].split()[:2] == ["streams", "pieces"])
    assert table <= head + 3  # the section's header, what its columns count, then the table
    assert [line.split()[0] for line in lines[table + 1:table + 3]] == ["1", "3"]
    assert lines[table + 2].split()[-1] == "3/3"
    assert any(line.startswith("member memory (MiB") for line in lines)


# ---------------------------------------------------------------------------------------- tokenfuse models
def test_weight_file_sizes_without_loading(tokenizer_dirs, tmp_path, capsys, monkeypatch):
    for name in DEFAULT_ENSEMBLE:  # the packages' data files are the GGUF, byte for byte
        gguf = BUNDLED[name].gguf_path(cache_dir())
        assert BUNDLED[name].weight_file_bytes(tmp_path) == {"gguf": gguf.stat().st_size}
    name = DEFAULT_ENSEMBLE[0]
    d = BUNDLED[name].model_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"\0" * 3 * 2**20)
    assert "converted" not in BUNDLED[name].weight_file_bytes(tmp_path)  # not marked converted: a partial write
    (d / MARK_MODEL).write_text("{}")
    assert BUNDLED[name].weight_file_bytes(tmp_path)["converted"] == 3 * 2**20

    monkeypatch.setenv("TOKENFUSE_CACHE", str(tmp_path))
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["name", "installed", "converted", "GGUF", "MiB", "fp32"]
    row = next(line.split() for line in lines if line.startswith(name + " "))
    assert row[3] == f"{BUNDLED[name].gguf_path(cache_dir()).stat().st_size / 2**20:.1f}" and row[4] == "3.0"
