"""The web playground and lm-eval's own ``local-completions`` client against the three real bundled
members (llama.cpp) behind ``tokenfuse serve``: the same checks as the tiny-member tests in
``test_playground.py`` and ``test_logprobs.py``, run on the default ensemble."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")

from test_logprobs import test_lm_eval_local_completions  # noqa: E402,F401  (run here on the real members)
from test_playground import (PROMPT, api, check_run, check_topk, driver, run_in_page,  # noqa: E402,F401
                             serving, wait_for)

from tokenfuse.engine import Ensemble  # noqa: E402
from tokenfuse.server import ServerSettings, create_app  # noqa: E402

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def ens(llamacpp_members, align_cache):
    return Ensemble(list(llamacpp_members.values()), align_cache=align_cache)


@pytest.fixture(scope="module")
def url(ens):
    with serving(create_app(ens, settings=ServerSettings(max_tokens=256))) as u:
        yield u


@pytest.fixture(scope="module")
def served(ens, url):
    return ens, url + "v1/completions"


@pytest.mark.parametrize("chat,gated", [(False, False), (True, True)])
def test_playground_on_the_real_members(driver, url, ens, chat, gated, tmp_path):
    names = [m.name for m in ens.members]
    options = {"gate": names[0], "threshold": 0.3} if gated else {}
    driver.get(url)
    wait_for(driver, "return document.body.dataset.connected === 'true';", 60)
    state = run_in_page(driver, prompt=PROMPT, controls={"max-tokens": "12", "temperature": "0", "chat": chat,
                                                         **{k: str(v) for k, v in options.items()}})
    assert state == "done", driver.find_element("id", "status").text
    body = {"max_tokens": 12, "temperature": 0,
            **({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})}
    ref = api(url, {**body, "tokenfuse": options})
    check_run(driver, ref, names)
    steps = ref["tokenfuse"]["trace"][0]["steps"]
    check_topk(driver, ref, 0, names)
    check_topk(driver, ref, len(steps) - 1, names)
    assert driver.save_screenshot(str(tmp_path / "playground-real.png"))
