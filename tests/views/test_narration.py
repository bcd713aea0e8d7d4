"""The progress bar: in place on a terminal, plain lines with no control characters in a log file or a pipe."""

from __future__ import annotations

import io

import pytest

from autoevolve.views import narration


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_updates_in_place_and_ends_with_a_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Terminal()
    monkeypatch.setattr("sys.stderr", err)
    for done in range(4):
        narration.print_progress("eval", done, 3, width=3)
    assert err.getvalue().count("\r") == 4 and err.getvalue().endswith("] 3/3 eval\x1b[K\n")
    assert err.getvalue().count("\n") == 1


def test_a_bar_in_a_log_file_is_plain_lines_the_last_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    err, clock = io.StringIO(), iter([0.0, 1.0, 31.0, 32.0, 33.0])
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(narration.time, "monotonic", lambda: next(clock))
    for done in range(5):
        narration.print_progress("train", done, 4, width=4, note=f" (loss {1 / (done + 1):.2f})")
    lines = err.getvalue().splitlines()
    assert lines == ["  [##..] 2/4 train (loss 0.33) (0.1/s, 31 s left)", "  [####] 4/4 train (loss 0.20)"]
    assert "\r" not in err.getvalue() and "\x1b" not in err.getvalue()
