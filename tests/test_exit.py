"""Releasing an ensemble's members: ``Ensemble.unload``, ``with``, and a script that exits quietly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tokenfuse import Ensemble, TokenfuseError
from tokenfuse.members.fasttok import FastTokenizer
from tokenfuse.members.remote import RemoteMember
from tokenfuse.members.transformers import TransformersMember

ROOT = Path(__file__).resolve().parents[1]


def _script_env() -> dict[str, str]:
    """The environment a script of the repo runs in: its ``src`` first; a crash says where it happened
    (faulthandler; glibc's fatal messages on stderr instead of the terminal)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
                PYTHONFAULTHANDLER="1", LIBC_FATAL_STDERR_="1")


def run_script(code: str) -> subprocess.CompletedProcess:
    """``code`` run as a script from the repo root, once. (Scripts were once killed by SIGABRT before
    their members loaded, 2 of 4 full suites: the loader threads' concurrent llama.cpp build check,
    ``llamacpp_lib.system_info``. Nothing reruns a script now: such a death fails the test.)"""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_script_env(), capture_output=True, text=True,
                          timeout=600)


def readme_python_example() -> str:
    """The first ```python block under the README's first "## ...Python..." heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.split(r"\n## [^\n]*Python[^\n]*\n", text, maxsplit=1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def pair(make_tiny, one_thread):
    """Two fresh tiny members (their models are shared with other tests; unloading drops only these)."""
    return [make_tiny("smollm2", seed=0, name="A"), make_tiny("qwen", seed=1, name="B")]


def test_with_unloads_and_later_use_is_a_clear_error(pair, align_cache):
    with Ensemble(pair, align_cache=align_cache) as ens:
        assert ens.generate("Hi", max_new_tokens=3).steps == 3
        seq = ens.open("Hello", max_new_tokens=4)
        ens.step([seq])
        stream = ens.stream("Once", max_new_tokens=4)
        next(stream)
    assert all(m.unloaded and m.model is None for m in pair)
    with pytest.raises(TokenfuseError, match="member 'A' was unloaded"):
        ens.generate("Hi", max_new_tokens=3)
    with pytest.raises(TokenfuseError, match="unloaded"):
        ens.step([seq])  # a sequence opened before
    with pytest.raises(TokenfuseError, match="unloaded"):
        ens.loglikelihood([("The sky is", " blue")])
    ens.close(seq)  # freeing what is left stays safe
    stream.close()
    ens.unload()  # twice: nothing more to do


def test_an_error_in_the_block_still_unloads(pair, align_cache):
    with pytest.raises(ValueError, match="boom"), Ensemble(pair, align_cache=align_cache):
        raise ValueError("boom")
    assert all(m.unloaded for m in pair)


def test_shared_members_and_shared_models(pair, align_cache):
    base = Ensemble(pair, align_cache=align_cache)
    a = pair[0]
    copy = TransformersMember("A2", a.model, a.tokenizer, align_cache=align_cache)  # a self-ensemble's copy
    want = Ensemble.single(copy, align_cache=align_cache).generate("Hi", max_new_tokens=3).text
    other = base.variant(weights={"A": 2.0})  # the same loaded members, another weight: a server request's
    assert other.members[0] is a and other.weights == [2.0, 1.0] and base.weights == [1.0, 1.0]
    other.unload()  # unloads the loaded members it shares with base, once
    assert a.unloaded and pair[1].unloaded
    base.unload()  # again for the same members: harmless
    with pytest.raises(TokenfuseError, match="unloaded"):
        base.generate("Hi", max_new_tokens=3)
    assert Ensemble.single(copy, align_cache=align_cache).generate("Hi", max_new_tokens=3).text == want


def test_remote_member_closes_only_its_own_client(tokenizer_dirs, align_cache):
    tok = FastTokenizer(tokenizer_dirs["smollm2"])
    own = RemoteMember("r", tok, base_url="http://127.0.0.1:1/v1", model="m", align_cache=align_cache)
    given = httpx.Client()
    lent = RemoteMember("g", tok, base_url="http://127.0.0.1:1/v1", model="m", client=given, align_cache=align_cache)
    st = own.new_state(own.encode_prompt("Hello"))
    for m in (own, lent):
        m.unload()
        m.unload()
    assert own.client.is_closed and not given.is_closed
    with pytest.raises(TokenfuseError, match="member 'r' was unloaded"):
        own.next_topk([st], 3)
    with pytest.raises(TokenfuseError, match="member 'g' was unloaded"):
        lent.new_state([1, 2])
    given.close()


@pytest.mark.real
def test_llamacpp_shared_model_is_freed_with_its_last_member():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh installs it)")
    from tokenfuse.config import MemberConfig, parse_config
    from tokenfuse.load import load_ensemble, load_member
    from tokenfuse.placement.local import share_member

    first = load_member(MemberConfig(name="o", source="smollm2-135m-instruct", backend="llamacpp"), progress=False)
    copy = share_member(first, MemberConfig(name="s", source="smollm2-135m-instruct", backend="llamacpp"))
    alone, other = Ensemble.single(first), Ensemble.single(copy)
    want = other.generate("The capital of France is", max_new_tokens=6).text
    alone.generate("The capital of France is", max_new_tokens=6)
    alone.unload()
    assert first.unloaded and copy.llm is first.llm and copy.llm.model is not None
    assert other.generate("The capital of France is", max_new_tokens=6).text == want
    other.unload()
    assert copy.llm.model is None  # freed with the last member on it

    cfg = parse_config({"members": [{"name": "a", "source": "smollm2-135m-instruct", "backend": "llamacpp"},
                                    {"name": "b", "source": "smollm2-135m-instruct", "backend": "llamacpp"}]})
    with load_ensemble(cfg, progress=False) as ens:  # a self-ensemble: one model, two members
        a, b = ens.members
        assert a.llm is b.llm
        seq = ens.open("Hello", max_new_tokens=4)
        ens.step([seq])
    assert a.llm.model is None
    with pytest.raises(TokenfuseError, match="unloaded"):
        ens.step([seq])
    ens.close(seq)


@pytest.mark.real
def test_readme_python_example_exits_cleanly(tokenizer_dirs):
    """The README's Python quick start, run as a script, leaves nothing on stderr but progress lines:
    no traceback at exit (llama-cpp-python freeing its models after its module is gone)."""
    run = run_script(readme_python_example())
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
    assert "Paris" in run.stdout


HAND_BUILT = """
from tokenfuse.config import MemberConfig
from tokenfuse.engine import Ensemble
from tokenfuse.load import load_member

members = [load_member(MemberConfig(name=n, backend="llamacpp"), progress=False)
           for n in ("smollm2-135m-instruct", "gemma3-270m")]
ens = Ensemble(members)  # built by hand, never unloaded: the engine's exit hook does it
print(ens.generate("The capital of France is", max_new_tokens=4).steps)
"""


@pytest.mark.real
def test_a_hand_built_ensemble_left_open_exits_cleanly(tokenizer_dirs):
    run = run_script(HAND_BUILT)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
    assert run.stdout.strip() == "4"
