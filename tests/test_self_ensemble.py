"""Self-ensembles: a model repeated in ``--models`` becomes distinct members sharing one loaded model,
and an ensemble of a model with itself generates what the model alone generates."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_model
from tokenfuse.cli import main
from tokenfuse.config import config_from_models, parse_config
from tokenfuse.engine import Ensemble
from tokenfuse.errors import ConfigError
from tokenfuse.load import load_ensemble
from tokenfuse.placement.local import shared_with

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_repeated_model_gets_numbered_copies():
    cfg = config_from_models("gemma3-270m,smollm2-135m-instruct,gemma3-270m,models/gemma3-270m.gguf")
    assert [(m.name, m.source) for m in cfg.members] == [
        ("gemma3-270m", "gemma3-270m"), ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("gemma3-270m#2", "gemma3-270m"), ("gemma3-270m#3", "models/gemma3-270m.gguf")]


def test_a_config_repeating_a_name_says_how_to_repeat_a_source():
    with pytest.raises(ConfigError) as err:
        parse_config({"members": [{"name": "gemma3-270m"}, {"name": "smollm2-135m-instruct"},
                                  {"name": "gemma3-270m"}]})
    assert str(err.value) == (
        "config: members: names must be unique; repeated: gemma3-270m; to ensemble a model with itself give "
        "each copy its own name with the same source (`name: gemma3-270m#2`, `source: gemma3-270m`), or repeat "
        "it in --models (gemma3-270m,gemma3-270m)")


def test_copies_share_only_a_model_loaded_the_same_way():
    members = parse_config({"members": [
        {"name": "a", "source": "gemma3-270m"},
        {"name": "b", "source": "smollm2-135m-instruct"},
        {"name": "c", "source": "gemma3-270m", "weight": 2.0, "score": 0.5},  # own weight and score: shared
        {"name": "d", "source": "gemma3-270m", "n_ctx": 512},  # another context size: its own model
        {"name": "gemma3-270m"},  # the source defaults to the name
        {"name": "e", "source": "gemma3-270m", "backend": "transformers"},
        {"name": "f", "source": "gemma3-270m", "backend": "transformers"},
        {"name": "r1", "backend": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m"},
        {"name": "r2", "backend": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m"},  # remote: never
    ], "method": "unite"}).members
    assert shared_with(members) == [0, 1, 0, 3, 0, 5, 5, 7, 8]


# ---------------------------------------------------------------------------------------- tiny members
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizers):
    """A tiny random-weight model on SmolLM2's real tokenizer, saved as a local model directory."""
    d = tmp_path_factory.mktemp("models") / "tiny-smollm2"
    tok = tokenizers["smollm2"]
    tiny_model(len(tok), seed=3).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_a_self_ensemble_shares_the_model_and_generates_what_it_generates(tiny_dir, tmp_path):
    cfg = config_from_models(f"{tiny_dir},{tiny_dir}", cache_dir=str(tmp_path))
    ens = load_ensemble(cfg, progress=False)
    first, copy = ens.members
    assert (first.name, copy.name) == ("tiny-smollm2", "tiny-smollm2#2")
    assert copy.model is first.model and copy.tokenizer is first.tokenizer  # loaded once
    alone = Ensemble.single(first, align_cache=tmp_path / "alignment")
    prompt = "The capital of France is"
    expected = alone.generate(prompt, max_new_tokens=12).text
    assert expected  # a random model still writes something: the comparison below means something
    assert ens.generate(prompt, max_new_tokens=12).text == expected
    for method in ("gac", "unite"):  # every step combined, no agreement skip
        combined = Ensemble(ens.members, method=method, agreement_skip=False, align_cache=tmp_path / "alignment")
        assert combined.generate(prompt, max_new_tokens=12).text == expected, method


def generate_json(capsys, *argv) -> dict:
    code = main(["generate", *argv, "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    return json.loads(out)


def test_the_command_line_repeats_a_model(tiny_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENFUSE_CACHE", str(tmp_path))
    args = ("Once upon a time", "--max-new-tokens", "10")
    alone = generate_json(capsys, *args, "--models", str(tiny_dir))
    twice = generate_json(capsys, *args, "--models", f"{tiny_dir},{tiny_dir}")
    assert [m["name"] for m in twice["members"]] == ["tiny-smollm2", "tiny-smollm2#2"]
    assert twice["text"] == alone["text"] and twice["steps"] == alone["steps"] == 10


# ---------------------------------------------------------------------------------------- the real model
@pytest.mark.real
def test_gemma_with_itself_gives_gemmas_greedy_output(capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh installs it)")
    args = ("Question: What is the capital of France?\nAnswer:", "--max-new-tokens", "8")
    alone = generate_json(capsys, *args, "--models", "gemma3-270m")
    twice = generate_json(capsys, *args, "--models", "gemma3-270m,gemma3-270m")
    assert [m["name"] for m in twice["members"]] == ["gemma3-270m", "gemma3-270m#2"]
    assert alone["text"].strip()
    assert twice["text"] == alone["text"]
