"""How long work shows its progress: a tqdm bar on a terminal, one plain line per finished step otherwise.

Every progress display of tokenfuse (model loading and conversion, tokenizer builds, eval, select,
bench, DeePEn's matrices) goes through ``progress_bar``. When the stream (standard error by
default) is a terminal, it is a ``tqdm.auto`` bar; when it is not (a log file, a pipe, CI), no bar
is drawn and, when the step finishes (the bar is closed), one line is written::

    eval triviaqa-generate gac: 40/40 items in 58.3 s, 41.2 items/min, acc=0.550

(the description, the count, the time, the rate over this run's own items, then the postfix if
any). ``enabled=False`` shows nothing in either mode (the commands' ``--quiet``).
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm.auto import tqdm
from tqdm.std import tqdm as plain_tqdm


def on_terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (default: the current standard error) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class StepLines(plain_tqdm):
    """A tqdm that draws nothing and writes one plain line when it is closed (``progress_bar`` off a terminal)."""

    def display(self, msg=None, pos=None) -> bool:  # tqdm's documented hook for other front ends
        return False

    def close(self) -> None:
        if not self.disable:
            self.fp.write(self.line() + "\n")
            self.fp.flush()
        super().close()

    def line(self) -> str:
        """``desc: n/total units in S s, R units/min[, postfix]``: the rate counts the steps after
        ``initial``, and is left out of a one-step display."""
        d = self.format_dict
        unit = d["unit"] if d["unit"].endswith("s") else d["unit"] + "s"
        done = f"{d['n']}/{d['total']}" if d["total"] is not None else f"{d['n']}"
        elapsed = d["elapsed"]
        text = f"{d['prefix']}: {done} {unit} in {elapsed:.1f} s"
        if d["total"] != 1:
            rate = (d["n"] - d["initial"]) / elapsed * 60 if elapsed > 0 else 0.0
            text += f", {rate:.1f} {unit}/min"
        return text + (f", {d['postfix']}" if d["postfix"] else "")


def progress_bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "item",
                 enabled: bool = True, leave: bool = True, initial: int = 0,
                 file: IO[str] | None = None, **bar_options: Any) -> tqdm:
    """A progress display for ``total`` steps of ``unit`` (or over ``iterable``), used like a tqdm bar
    (``with progress_bar(...) as bar: bar.update(n)``, ``bar.set_postfix(...)``, or iterated).

    On a terminal (``file``, default standard error) a ``tqdm.auto`` bar (``leave``, ``bar_options``
    as tqdm's); elsewhere ``StepLines``: one line when it closes. ``initial``: steps already done
    before this run (a resumed eval), left out of the rate.
    """
    stream = sys.stderr if file is None else file
    if on_terminal(stream):
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, leave=leave,
                    initial=initial, file=stream, dynamic_ncols=True, **bar_options)
    return StepLines(iterable, total=total, desc=desc, unit=unit, disable=not enabled, leave=False,
                     initial=initial, file=stream)
