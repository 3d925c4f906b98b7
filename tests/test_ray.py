"""Ray placement on a local Ray instance (CPU): members in actors give the in-process output."""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'; scripts/setup.sh does)")

from conftest import tiny_model  # noqa: E402  (pickled by value into the actors)
from tokenfuse.engine import Ensemble  # noqa: E402
from tokenfuse.engine.sampling import Sampling  # noqa: E402
from tokenfuse.placement.ray import place_members  # noqa: E402

PROMPTS = ["The capital of France is", "def fib(n):"]
SPECS = [("smollm2", 0, "A"), ("qwen", 1, "B"), ("gemma3", 2, "C")]


def tiny_factory(tokenizer_dir, family, seed, name, align_cache):
    """Builds inside the actor the same tiny member ``make_tiny`` builds here."""
    import torch

    from tokenfuse.members.fasttok import FastTokenizer
    from tokenfuse.members.transformers import TransformersMember

    torch.set_num_threads(1)
    tok = FastTokenizer(tokenizer_dir)  # loads in a fraction of AutoTokenizer's time; same ids and bytes
    return TransformersMember(name, tiny_model(len(tok), seed=seed), tok, align_cache=align_cache)


@pytest.fixture(scope="module")
def ray_members(tokenizer_dirs, align_cache):
    import functools

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules["conftest"])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    factories = [functools.partial(tiny_factory, str(tokenizer_dirs[f]), f, s, n, align_cache) for f, s, n in SPECS]
    members = place_members(factories, num_cpus=[0.5] * 3, num_gpus=[0] * 3, strategy="PACK")
    yield members
    for m in members:
        ray.kill(m.actor)
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_members(make_tiny, one_thread):
    return [make_tiny(f, seed=s, name=n) for f, s, n in SPECS]


@pytest.mark.parametrize("method", ["gac", "unite"])
def test_ray_members_match_in_process(ray_members, local_members, align_cache, method):
    local = Ensemble(local_members, method=method, align_cache=align_cache)
    placed = Ensemble(ray_members, method=method, align_cache=align_cache)
    assert placed.union.pieces == local.union.pieces
    want = local.generate(PROMPTS, max_new_tokens=10)
    got = placed.generate(PROMPTS, max_new_tokens=10)
    assert [g.text for g in got] == [g.text for g in want]
    assert [g.member_ids for g in got] == [g.member_ids for g in want]
    messages = [{"role": "user", "content": "Hi"}]
    s = Sampling(temperature=0.8, seed=5)
    assert placed.generate(messages, chat=True, max_new_tokens=6, sampling=s).text == \
        local.generate(messages, chat=True, max_new_tokens=6, sampling=s).text


def test_gated_and_released(ray_members, local_members, align_cache):
    local = Ensemble(local_members, gate="A", threshold=0.2, align_cache=align_cache)
    placed = Ensemble(ray_members, gate="A", threshold=0.2, align_cache=align_cache)
    g1, g2 = local.generate(PROMPTS[1], max_new_tokens=10), placed.generate(PROMPTS[1], max_new_tokens=10)
    assert (g2.text, g2.ensembled_steps) == (g1.text, g1.ensembled_steps)
    # generate() closed its sequences: every actor has freed them
    ray.get([m.actor.release.remote([]) for m in ray_members])
    assert all(not ray.get(m.actor.__ray_call__.remote(lambda a: len(a.states))) for m in ray_members)


@pytest.mark.real
def test_config_placement_ray(ray_members, llamacpp_members):
    """`placement: ray` in a config: the bundled SmolLM2 on llama.cpp in an actor, as in-process."""
    from tokenfuse.config import parse_config
    from tokenfuse.load import load_ensemble

    cfg = parse_config({"members": [{"name": "smollm2-135m-instruct", "backend": "llamacpp", "num_cpus": 0.5}],
                        "placement": "ray", "placement_strategy": "SPREAD"})
    placed = load_ensemble(cfg, progress=False)
    local = Ensemble([llamacpp_members["smollm2"]])
    prompt = "Question: What is the capital of France?\nAnswer:"
    assert placed.generate(prompt, max_new_tokens=8).text == local.generate(prompt, max_new_tokens=8).text
    placed.unload()  # its actor and placement group


def test_ray_member_declares_what_the_local_member_does(ray_members, local_members):
    """Context length, chat template and default weight come from the actor's member (a score is the
    ensemble's, ``Ensemble.scores``, never a member's); its model weights stay there."""
    from tokenfuse.errors import TokenfuseError
    from tokenfuse.placement.ray import RayMember

    for placed, local in zip(ray_members, local_members):
        assert placed.context_length == local.context_length == 2048
        assert placed.has_chat_template is local.has_chat_template
        assert placed.weight == local.weight == 1.0 and not hasattr(placed, "score")
    actor = ray_members[0].actor
    ray.get(actor.__ray_call__.remote(lambda a: setattr(a.member, "weight", 0.5)))
    try:
        assert RayMember(actor, ray.get(actor.info.remote())).weight == 0.5
    finally:
        ray.get(actor.__ray_call__.remote(lambda a: setattr(a.member, "weight", 1.0)))
    with pytest.raises(TokenfuseError, match="DeePEn needs local weights"):
        ray_members[0].input_embeddings()


def test_unload_ends_the_actors_and_then_the_placement_group(ray_members, tokenizer_dirs, align_cache):
    import functools

    from ray.util import placement_group_table

    from tokenfuse.errors import TokenfuseError

    factories = [functools.partial(tiny_factory, str(tokenizer_dirs["smollm2"]), "smollm2", s, n, align_cache)
                 for s, n in ((0, "D"), (1, "E"))]
    members = place_members(factories, num_cpus=[0.25] * 2, num_gpus=[0] * 2)
    ens = Ensemble(members, align_cache=align_cache)
    ens.generate(PROMPTS[0], max_new_tokens=3)
    pg = members[0].placement_group
    members[0].unload()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(members[0].actor.info.remote(), timeout=60)
    assert placement_group_table(pg)["state"] == "CREATED"  # its other member still runs in it
    ens.unload()
    assert placement_group_table(pg)["state"] == "REMOVED"
    with pytest.raises(TokenfuseError, match="member 'D' was unloaded"):
        ens.generate(PROMPTS[0], max_new_tokens=3)
