"""The lm-evaluation-harness plugin: text-level combination, the LM methods, and a local-task run (no network)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("lm_eval")

from tokenfuse import Ensemble  # noqa: E402
from tokenfuse.lm_eval_plugin import TokenfuseLM, combine_loglikelihoods  # noqa: E402


class Req:
    """The part of ``lm_eval.api.instance.Instance`` the model reads."""

    def __init__(self, *args):
        self.args = args


def test_combine_loglikelihoods():
    assert combine_loglikelihoods([-1.0, -3.0], [1, 1]) == -2.0
    assert combine_loglikelihoods([-1.0, -3.0], [3, 1]) == -1.5
    assert combine_loglikelihoods([-1.0, -3.0], [1, 1], "mixture") == pytest.approx(
        math.log(0.5 * math.exp(-1) + 0.5 * math.exp(-3)))
    assert combine_loglikelihoods([-1.0, -math.inf], [1, 0], "mixture") == -1.0  # weight 0 is silent


def test_model_args_go_through_the_config_override_rule(monkeypatch, tmp_path):
    """``config``/``models`` plus ``method``/``gate``/``threshold``/``primary`` make the config that is loaded
    (``EnsembleConfig.with_overrides``: another method drops the config's params)."""
    import tokenfuse.load
    from tokenfuse.errors import ConfigError

    seen = []
    monkeypatch.setattr(tokenfuse.load, "load_ensemble", lambda cfg, progress=True: seen.append(cfg))
    TokenfuseLM._load(None, "a+b", method=None, gate="b", threshold="0.4", primary="b")
    assert [m.name for m in seen[0].members] == ["a", "b"]
    assert (seen[0].method, seen[0].gate, seen[0].threshold, seen[0].primary) == ("gac", "b", 0.4, "b")
    path = tmp_path / "ens.yaml"
    path.write_text("members: [{name: a}, {name: b}]\nmethod: unite\nparams: {k: 5}\n")
    TokenfuseLM._load(str(path), None, method="gac", gate=None, threshold=None, primary=None)
    assert (seen[1].method, seen[1].params) == ("gac", {})
    with pytest.raises(ConfigError, match="^model_args: threshold: gate 'b' needs a threshold"):
        TokenfuseLM._load(None, "a+b", method=None, gate="b", threshold=None, primary=None)


@pytest.fixture(scope="module")
def pair(make_tiny, one_thread):
    return Ensemble([make_tiny("smollm2", seed=1, name="s"), make_tiny("gemma3", seed=2, name="g")])


def test_loglikelihood_text_and_token_level(pair):
    reqs = [Req("Question: 2+2?\nAnswer:", " 4"), Req("The sky is", " blue today")]
    text = TokenfuseLM(ensemble=pair).loglikelihood(reqs)
    singles = [Ensemble([m]).loglikelihood([r.args for r in reqs]) for m in pair.members]
    for k, (lp, greedy) in enumerate(text):
        assert lp == pytest.approx((singles[0][k].logprob + singles[1][k].logprob) / 2, abs=1e-5)
        assert greedy is False
    token = TokenfuseLM(ensemble=pair, loglikelihood="token").loglikelihood(reqs)
    direct = pair.loglikelihood([r.args for r in reqs])
    assert [lp for lp, _ in token] == pytest.approx([d.logprob for d in direct], abs=1e-5)


def test_loglikelihood_on_bytes(pair):
    """``loglikelihood=bytes`` with ``method=byte``: the byte method's likelihood on bytes, and rolling the
    whole string's bytes (no context); refused without the byte method."""
    from tokenfuse.errors import TokenfuseError

    ens = pair.variant(pair.options.replace(method="byte"))
    lm = TokenfuseLM(ensemble=ens, loglikelihood="bytes")
    reqs = [Req("Question: 2+2?\nAnswer:", " 4"), Req("The sky is", " blue today")]
    direct = ens.loglikelihood([r.args for r in reqs])
    assert [lp for lp, _ in lm.loglikelihood(reqs)] == [d.logprob for d in direct]
    (roll,) = lm.loglikelihood_rolling([Req("hello world")])
    assert roll == ens.loglikelihood([("", "hello world")])[0].logprob and math.isfinite(roll)
    with pytest.raises(TokenfuseError, match="loglikelihood: bytes scores the byte method's mixture; give method=byte"):
        TokenfuseLM(ensemble=pair, loglikelihood="bytes")


def test_rolling_and_empty_context(pair):
    lm = TokenfuseLM(ensemble=pair)
    (roll,) = lm.loglikelihood_rolling([Req("hello world")])
    (empty,) = lm.loglikelihood([Req("", "hello world")])
    assert math.isfinite(roll) and roll == pytest.approx(empty[0])
    # SmolLM2 adds no BOS to a prompt: an empty one is conditioned on its BOS token alone
    smol = pair.members[0]
    assert smol.encode_prompt("hi")[0] != smol.tokenizer.bos_token_id
    assert smol.encode_prompt("") == [smol.tokenizer.bos_token_id]


def test_generate_until_stops_and_trims(pair):
    lm = TokenfuseLM(ensemble=pair)
    out = lm.generate_until([Req("Once upon a time", {"until": ["e"], "max_gen_toks": 6}),
                             Req("Hello", {"until": ["\n"], "max_gen_toks": 3})])
    assert len(out) == 2 and all("e" not in o for o in out[:1])
    direct = pair.generate("Hello", max_new_tokens=3, stop=["\n"])
    assert out[1] == direct.text


MC = [{"question": "What is 2+2?", "choices": ["4", "5"], "gold": 0},
      {"question": "Color of the sky?", "choices": ["green", "blue"], "gold": 1},
      {"question": "Opposite of hot?", "choices": ["cold", "warm"], "gold": 0}]


def test_simple_evaluate_on_local_json_tasks(pair, tmp_path, monkeypatch):
    """A local JSON task YAML for each request type, run through lm_eval.simple_evaluate offline."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MC), encoding="utf-8")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tmp_path / "tf_mc.yaml").write_text(
        "task: tf_mc\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n", encoding="utf-8")
    (tmp_path / "tf_gen.yaml").write_text(
        "task: tf_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: \"{{choices[gold]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n", encoding="utf-8")
    (tmp_path / "tf_roll.yaml").write_text(
        "task: tf_roll\n" + common + "output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{question}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n", encoding="utf-8")
    lm = TokenfuseLM(ensemble=pair, batch_size=4)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tf_mc", "tf_gen", "tf_roll"], bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=False)
    res = out["results"]
    assert 0.0 <= res["tf_mc"]["acc,none"] <= 1.0
    assert res["tf_gen"]["exact_match,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert res["tf_roll"]["bits_per_byte,none"] > 0


def test_model_args_refuse_what_they_do_not_take(monkeypatch):
    """An unknown model argument is an error naming it (never silently dropped); every ensemble option
    reaches the config, ``params`` and ``weights`` among them; lm-eval's own batch_size/max_batch_size/device
    are taken."""
    import tokenfuse.load
    from tokenfuse.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model_args: unknown argument 'colour'; the tokenfuse model takes config, "):
        TokenfuseLM(models="a+b", colour="red")
    seen = []

    class Loaded(Exception):
        pass

    def load_ensemble(cfg, progress=True):
        seen.append(cfg)
        raise Loaded

    monkeypatch.setattr(tokenfuse.load, "load_ensemble", load_ensemble)
    with pytest.raises(Loaded):  # as lm-eval's create_from_arg_string passes them
        TokenfuseLM.create_from_arg_string("models=a+b,method=unite,params={k: 3},weights=2+1,window=4,"
                                           "speculative=true,agreement_skip=false",
                                           {"batch_size": 4, "max_batch_size": None, "device": "cpu"})
    cfg = seen[0]
    assert (cfg.method, cfg.params, [m.weight for m in cfg.members], cfg.window) == ("unite", {"k": 3}, [2.0, 1.0], 4)
    assert (cfg.speculative.k, cfg.agreement_skip) == (4, False)


def test_model_args_apply_to_a_given_ensemble(pair):
    lm = TokenfuseLM(ensemble=pair, method="unite", weights=[1, 0], batch_size="auto", max_batch_size=3)
    assert (lm.ensemble.options.method, lm.ensemble.weights, lm.batch_size) == ("unite", [1.0, 0.0], 3)
    assert lm.ensemble.members[0] is pair.members[0]
