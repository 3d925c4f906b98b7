"""lm-evaluation-harness plugin: a tokenfuse ensemble as the ``tokenfuse`` model of ``lm_eval`` (v0.4.x).

Use from Python (lm-eval 0.4 has no entry-point discovery, so import this module first)::

    import lm_eval
    from tokenfuse.lm_eval_plugin import TokenfuseLM
    lm = TokenfuseLM(models="smollm2-135m-instruct+gemma3-270m", method="gac")
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"], limit=50)

or from the shell, through the console script that registers the model and then runs lm-eval's
own command line::

    tokenfuse-lm-eval run --model tokenfuse --model_args config=examples/default.yaml --tasks arc_easy

Model arguments (``--model_args key=value,...``; ``model_arguments()`` lists them): ``config`` (an
ensemble YAML) or ``models`` (members separated by ``+``); every ensemble option the plugin honours,
built from the options' declarations (``tokenfuse.config.override_fields``): ``method``, ``params``
(a YAML mapping: ``params={k: 5}``), ``primary``, ``agreement_skip``, ``gate``, ``threshold``,
``window``, ``scoring``, ``parallel``, ``speculative`` (``true``, or a YAML mapping ``{k: 2}``) and
``weights`` (``2+1``, in member order, or ``{name: weight}``), applied to the config by
``EnsembleConfig.with_overrides``; ``loglikelihood`` (``text``, default, ``token``, or ``bytes``
with ``method=byte``), ``combine`` (``mean``, default, or ``mixture``), ``chat`` (``true``: each
context is sent as one user message, rendered by each member's own template), ``batch_size``
(default 8; ``auto``: ``max_batch_size``, else 8), ``max_gen_toks`` (default 256). lm-eval passes
``batch_size``, ``max_batch_size`` and ``device`` to every model (and ``trust_remote_code`` with its
``--trust_remote_code``); ``device`` and ``trust_remote_code`` are accepted with a warning (a
member's are its config's). Any other argument, and an option the plugin
cannot honour (``Option.refused``), is refused with an error naming it (never silently dropped).

Requests:

* ``generate_until`` — greedy (or sampled, from ``do_sample``/``temperature``/``top_p``/``top_k``/
  ``seed``) generation through the lockstep engine; ``until`` strings stop it and are trimmed;
  ``max_gen_toks`` (default 256) counts chosen pieces.
* ``loglikelihood`` with ``loglikelihood=text`` (default) — a heterogeneous ensemble has no shared
  token space, so each member scores the continuation in its own tokenization
  (``Ensemble.single(member).loglikelihood``: its own log-probabilities of its own tokens of the
  continuation, each renormalised over its text + END ids), and the members' log-likelihoods are
  combined as text-level numbers: ``combine=mean`` gives the weighted mean ``sum_i w_i log p_i``
  (a weighted geometric mean of the members' sequence probabilities; the eval runner's ``seq-avg``
  baseline is this divided by the continuation's bytes), ``combine=mixture`` gives
  ``log sum_i w_i p_i`` (the probability under a mixture of the members). Weights are the members'
  normalised weights. With ``loglikelihood=token`` the continuation is scored under the
  token-level ensemble instead (``Ensemble.loglikelihood``: teacher-forced through the same
  engine and combiner). ``is_greedy`` is not computed and is always ``False`` (tasks whose metric
  needs it, e.g. LAMBADA ``acc``, are not supported). With ``loglikelihood=bytes`` (and
  ``method=byte``): on bytes, the mixture of the members' byte models of context + continuation
  (``Ensemble.loglikelihood`` of the byte method, ``engine/bytescore.py``; its ``params.mix`` and fit).
* ``loglikelihood_rolling`` — with ``loglikelihood=bytes``, the byte mixture's log-probability of the
  whole string's bytes (no context: each member's byte model from its start ids). Otherwise the text-level combination of each member's log-likelihood of the
  whole string, conditioned on the member's BOS token (else its EOS token), as lm-eval's
  ``prefix_token_id``. The string is not split into windows: it must fit each member's context.

An empty context is conditioned on the member's BOS/EOS token in the same way (the engine's
``Member.encode_prompt`` encodes an empty prompt as that one id).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: it loads them only into an empty registry)
import yaml
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from pydantic import ValidationError

from tokenfuse.config import config_from_source, override_fields
from tokenfuse.engine import Ensemble, EnsembleOptions, Sampling
from tokenfuse.engine.options import kind, options_error, refusal
from tokenfuse.errors import ConfigError, TokenfuseError

log = logging.getLogger(__name__)


def _bool(x) -> bool:
    return x if isinstance(x, bool) else str(x).strip().lower() in ("1", "true", "yes", "on")


def combine_loglikelihoods(logprobs: Sequence[float], weights: Sequence[float], how: str = "mean") -> float:
    """Text-level combination of the members' log-likelihoods of one continuation (see the module docstring)."""
    total = sum(weights)
    if total <= 0:
        raise TokenfuseError("weights: at least one member needs a positive weight")
    pairs = [(lp, w / total) for lp, w in zip(logprobs, weights) if w > 0]
    if how == "mean":
        return sum(w * lp for lp, w in pairs)
    if how == "mixture":
        top = max(lp for lp, _ in pairs)
        if top == -math.inf:
            return -math.inf
        return top + math.log(sum(w * math.exp(lp - top) for lp, w in pairs))
    raise TokenfuseError(f"combine: expected mean or mixture, got {how!r}")


# the plugin's own model arguments besides the ensemble options (``model_arguments``), and those lm-eval
# passes to every model's constructor (``LM.create_from_arg_string``'s ``additional_config``)
OWN_ARGUMENTS = {
    "config": "an ensemble config YAML", "models": "members separated by +",
    "loglikelihood": "text (default), token or bytes", "combine": "mean (default) or mixture",
    "chat": "true: each context as one user message", "batch_size": "requests per call (default 8)",
    "max_gen_toks": "generation limit (default 256)",
    "max_batch_size": "lm-eval's: the batch size of batch_size=auto",
    "device": "lm-eval's: not used, with a warning (each member's device is its config's)",
    "trust_remote_code": "lm-eval's: not used, with a warning (each member's is its config's)",
}


def model_arguments(options: type[EnsembleOptions] | None = None) -> dict[str, str]:
    """Every model argument of the ``tokenfuse`` model, with what it is: its own (``OWN_ARGUMENTS``)
    and each override the plugin honours (``options``: default ``EnsembleOptions``)."""
    return {**OWN_ARGUMENTS, **{n: o.help for n, (_, o) in override_fields(options, "lm_eval").items()}}


def model_options(given: Mapping[str, Any], options: type[EnsembleOptions] | None = None) -> dict[str, Any]:
    """The ensemble options among model arguments ``given`` (the plugin's own taken out), their text read
    (a YAML mapping for ``params``/``speculative``, ``W+W`` for ``weights``); an unknown argument or an
    option the plugin cannot honour raises ``ConfigError`` naming it."""
    fields = override_fields(options)
    out = {}
    for name, value in given.items():
        if name not in fields:
            raise ConfigError(f"model_args: unknown argument {name!r}; the tokenfuse model takes "
                                 f"{', '.join(model_arguments(options))}")
        info, opt = fields[name]
        if "lm_eval" in opt.refused:
            raise ConfigError(f"model_args: {refusal(name, opt, 'lm_eval')}")
        out[name] = _from_text(name, value, kind(info.annotation))
    return out


def _from_text(name: str, value: Any, how: str) -> Any:
    if how == "list" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]  # one weight (lm-eval reads "2" as a number)
    if not isinstance(value, str):
        return value
    if how == "switch":
        return _bool(value)
    if how == "list" and not value.lstrip().startswith(("{", "[")):
        return value.split("+")
    if how in ("mapping", "list", "model"):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"model_args: {name}: not valid YAML ({' '.join(str(err).split())}): {value!r}") from None
    return value


@register_model("tokenfuse")
class TokenfuseLM(LM):
    """A tokenfuse ensemble behind lm-eval's ``LM`` interface (see the module docstring)."""

    def __init__(self, config: str | None = None, models: str | None = None, loglikelihood: str = "text",
                 combine: str = "mean", chat: bool | str = False, batch_size: int | str = 8,
                 max_gen_toks: int | str = 256, max_batch_size: int | str | None = None, device: str | None = None,
                 trust_remote_code: bool | None = None, ensemble=None, **options) -> None:
        super().__init__()
        if loglikelihood not in ("text", "token", "bytes"):
            raise TokenfuseError(f"loglikelihood: expected text, token or bytes, got {loglikelihood!r}")
        if combine not in ("mean", "mixture"):
            raise TokenfuseError(f"combine: expected mean or mixture, got {combine!r}")
        options = model_options({k: v for k, v in options.items() if v is not None})
        if device is not None:
            log.warning("tokenfuse: device=%s is not used: each member runs on its config's `device`", device)
        if trust_remote_code:
            log.warning("tokenfuse: trust_remote_code is not used: each member's is its config's `trust_remote_code`")
        if ensemble is None:
            ensemble = self._load(config, models, **options)
        elif options:
            ensemble = self._variant(ensemble, options)
        if loglikelihood == "bytes" and ensemble.options.method != "byte":
            raise TokenfuseError(f"loglikelihood: bytes scores the byte method's mixture; give method=byte (the "
                                 f"ensemble's method is {ensemble.options.method})")
        self.ensemble = ensemble
        self.singles = [Ensemble.single(m, window=ensemble.options.window) for m in ensemble.members]
        self.mode, self.combine, self.chat = loglikelihood, combine, _bool(chat)
        auto = int(max_batch_size) if str(max_batch_size).isdigit() else 8
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else auto
        self.max_gen_toks = int(max_gen_toks)

    @staticmethod
    def _load(config, models, **options):
        """The ensemble of ``model_args``: the config (or ``+``-separated members), options applied."""
        from tokenfuse.load import load_ensemble

        cfg = config_from_source(config=config, models=models and models.replace("+", ",").replace("|", ","))
        cfg = cfg.with_overrides(**{k: v for k, v in options.items() if v is not None}, origin="model_args")
        return load_ensemble(cfg, progress=False)

    @staticmethod
    def _variant(ensemble: Ensemble, options: dict[str, Any]) -> Ensemble:
        """An ensemble given in Python with model arguments' options: its variant with them applied."""
        weights = options.pop("weights", None)
        try:
            return ensemble.variant(ensemble.options.replace(**options) if options else None, weights=weights)
        except ValidationError as err:
            raise ConfigError(options_error(err, "model_args")) from None

    # ------------------------------------------------------------------ helpers
    @property
    def weights(self) -> list[float]:
        return list(self.ensemble.weights)

    @staticmethod
    def _prefix(member) -> str:
        """The text of the member's BOS (else EOS) token: the condition of an empty context."""
        tok = member.tokenizer
        for attr in ("bos_token", "eos_token"):
            text = getattr(tok, attr, None)
            if text:
                return text
        raise TokenfuseError(f"{member.name}: no BOS or EOS token to condition an empty context on")

    def _member_context(self, member, context: str) -> str:
        return context if member.encode_prompt(context) else self._prefix(member) + context

    def _text_level(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        per_member = []
        for m, w, single in zip(self.ensemble.members, self.weights, self.singles):
            if w <= 0:
                per_member.append([0.0] * len(pairs))
                continue
            reqs = [(self._member_context(m, c), x) for c, x in pairs]
            per_member.append([lk.logprob for lk in self._batched(single.loglikelihood, reqs)])
        return [combine_loglikelihoods([pm[k] for pm in per_member], self.weights, self.combine)
                for k in range(len(pairs))]

    def _batched(self, fn, items: list) -> list:
        out = []
        for start in range(0, len(items), self.batch_size):
            out.extend(fn(items[start:start + self.batch_size]))
        return out

    # ------------------------------------------------------------------ LM interface
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args) for r in requests]
        if self.mode == "bytes":
            scores = [lk.logprob for lk in self._batched(self.ensemble.loglikelihood, pairs)]
        elif self.mode == "text":
            scores = self._text_level(pairs)
        else:
            scores = [0.0] * len(pairs)
            empty = [k for k, (c, _) in enumerate(pairs) if not c]
            full = [k for k, (c, _) in enumerate(pairs) if c]
            for k, s in zip(empty, self._text_level([pairs[k] for k in empty]) if empty else []):
                scores[k] = s
            liks = self._batched(self.ensemble.loglikelihood, [pairs[k] for k in full])
            for k, lk in zip(full, liks):
                scores[k] = lk.logprob
        for req, s in zip(requests, scores):
            self.cache_hook.add_partial("loglikelihood", req.args, (s, False))
        return [(s, False) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs = [("", r.args[0]) for r in requests]
        scores = ([lk.logprob for lk in self._batched(self.ensemble.loglikelihood, pairs)] if self.mode == "bytes"
                  else self._text_level(pairs))
        for req, s in zip(requests, scores):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, s)
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[int]] = defaultdict(list)
        kwargs = []
        for k, r in enumerate(requests):
            ctx, gk = r.args
            gk = dict(gk or {})
            until = gk.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            do_sample = _bool(gk.get("do_sample", False)) and float(gk.get("temperature", 1.0) or 0) > 0
            sampling = Sampling(temperature=float(gk.get("temperature", 1.0)) if do_sample else 0.0,
                                top_p=float(gk.get("top_p", 1.0)), top_k=int(gk.get("top_k", 0) or 0),
                                seed=gk.get("seed"))
            limit = int(gk.get("max_gen_toks", self.max_gen_toks))
            kwargs.append((until, sampling, limit))
            groups[(tuple(until), repr(sampling), limit)].append(k)
        out: list[str] = [""] * len(requests)
        for idx in groups.values():
            until, sampling, limit = kwargs[idx[0]]
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start:start + self.batch_size]
                gens = self.ensemble.generate([requests[k].args[0] for k in chunk], max_new_tokens=limit,
                                              sampling=sampling, stop=until, chat=self.chat)
                for k, g in zip(chunk, gens):
                    out[k] = g.text
                    self.cache_hook.add_partial("generate_until", requests[k].args, g.text)
        return out


def cli_evaluate() -> None:
    """Console script ``tokenfuse-lm-eval``: lm-eval's command line with the ``tokenfuse`` model registered."""
    from lm_eval.__main__ import cli_evaluate as run

    run()
