"""What a run tells the person watching it: one logger, printed plainly on the terminal.

Narration (a stage loaded from the store, the round's plan, the 2x2 at the end) goes to the logger
``autoevolve.narration``. Its own handler prints each message as it is, on the current standard output; it does
not propagate, so nothing prints twice where the root logger has a console handler (Prefect's does). ``flows`` adds
Prefect's API handler to it, so the logs of a flow or task run, in the UI or from a deployed worker, hold the same
lines a terminal shows.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("autoevolve.narration")  # the name deployed runs log under


class TerminalHandler(logging.Handler):
    """Prints each record's message to ``sys.stdout`` as it is at the time (a test's capture, a redirected file)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _clear_bar()
            print(record.getMessage(), file=sys.stdout, flush=True)
        except Exception:  # a closed stream must not break a run
            self.handleError(record)


if not any(isinstance(h, TerminalHandler) for h in log.handlers):
    log.addHandler(TerminalHandler())
log.setLevel(logging.INFO)
log.propagate = False


def say(text: str) -> None:
    """Tell the person watching the run: on the terminal, and in the run's logs inside a Prefect run."""
    log.info(text)


def print_progress(label: str, done: int, total: int, width: int = 24, note: str = "") -> None:
    """A progress bar on stderr: what, how many of how many, a ``note`` that changes as it goes (the last loss),
    the rate and the time left (measured from the first call for this label). On a terminal one line updates in
    place and is cleared when the bar ends (the stage's summary line takes its place); elsewhere (a log file, a
    pipe) a plain line is written when the bar ends and at most every ``quiet_every()`` seconds before, with no
    control characters. A count of 0, or one below the last, begins the label's bar anew."""
    global _LIVE
    now = time.monotonic()
    if done == 0 or done < _LAST.get(label, 0):  # a new bar under a label an earlier one left unfinished
        _STARTED.pop(label, None)
        _SHOWN.pop(label, None)
    _LAST[label] = done
    started, shown = _STARTED.setdefault(label, (now, done)), _SHOWN.setdefault(label, now)
    rate = (done - started[1]) / (now - started[0]) if now > started[0] and done > started[1] else 0.0
    pace = f" ({rate:.1f}/s, {(total - done) / rate:.0f} s left)" if rate and done < total else ""
    filled = width * done // max(total, 1)
    finished = done >= total
    if finished:
        del _STARTED[label]
        _SHOWN.pop(label, None)
        _LAST.pop(label, None)
    line = f"  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}{note}{pace}"
    if sys.stderr.isatty():
        _LIVE = not finished
        print("\r\x1b[K" if finished else f"\r{line}\x1b[K", end="", file=sys.stderr, flush=True)
    elif finished or now - shown >= quiet_every():
        _SHOWN[label] = now
        print(line, file=sys.stderr, flush=True)


def _clear_bar() -> None:
    """Clear a live bar on the terminal before a line of narration is printed (the bar is drawn again on its next
    update), so the two never share a line."""
    global _LIVE
    if _LIVE and sys.stderr.isatty():
        print("\r\x1b[K", end="", file=sys.stderr, flush=True)
    _LIVE = False


def quiet_every() -> float:
    """Seconds between a bar's plain lines where stderr is no terminal: ``AUTOEVOLVE_PROGRESS_EVERY``, else 30."""
    value = os.environ.get("AUTOEVOLVE_PROGRESS_EVERY", "30")
    try:
        return max(float(value), 0.0)
    except ValueError:
        raise ValueError(f"AUTOEVOLVE_PROGRESS_EVERY={value!r} is no number of seconds; unset it or give one") from None


_LIVE = False  # a bar is drawn on the terminal's last line
_SHOWN: dict[str, float] = {}  # label -> when its last plain line was written (stderr no terminal)
_LAST: dict[str, int] = {}  # label -> the count its bar last showed
_STARTED: dict[str, tuple[float, int]] = {}  # label -> (when its bar began, the count then)
