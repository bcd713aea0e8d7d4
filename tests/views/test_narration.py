"""The progress bar: in place on a terminal, plain lines with no control characters in a log file or a pipe."""

from __future__ import annotations

import io

import pytest

from autoevolve.views import narration


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_updates_in_place_and_gives_way_to_narration(monkeypatch: pytest.MonkeyPatch) -> None:
    err, out = _Terminal(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    narration.print_progress("eval", 0, 3, width=3)
    narration.say("  gate: promote")  # a line of narration clears the live bar first
    for done in range(1, 4):
        narration.print_progress("eval", done, 3, width=3)
    assert err.getvalue().startswith("\r  [...] 0/3 eval\x1b[K\r\x1b[K\r  [#..] 1/3 eval")
    assert err.getvalue().endswith(" s left)\x1b[K\r\x1b[K") and "\n" not in err.getvalue()  # cleared at the end
    assert out.getvalue() == "  gate: promote\n"


def test_a_bar_in_a_log_file_is_plain_lines_the_last_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    err, clock = io.StringIO(), iter([-100.0, 0.0, 1.0, 31.0, 32.0, 33.0])
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(narration.time, "monotonic", lambda: next(clock))
    monkeypatch.delenv("AUTOEVOLVE_PROGRESS_EVERY", raising=False)
    narration.print_progress("train", 3, 9)  # a bar a crashed step left unfinished: the next one begins anew
    err.truncate(0)
    for done in range(5):
        narration.print_progress("train", done, 4, width=4, note=f" (loss {1 / (done + 1):.2f})")
    lines = err.getvalue().splitlines()
    assert lines == ["  [##..] 2/4 train (loss 0.33) (0.1/s, 31 s left)", "  [####] 4/4 train (loss 0.20)"]
    assert "\r" not in err.getvalue() and "\x1b" not in err.getvalue()


def test_the_seconds_between_plain_lines_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("AUTOEVOLVE_PROGRESS_EVERY", "0")
    for done in range(3):
        narration.print_progress("every", done, 2, width=2)
    assert [line.split(" (")[0] for line in err.getvalue().splitlines()] == [
        "  [..] 0/2 every",
        "  [#.] 1/2 every",
        "  [##] 2/2 every",
    ]
    monkeypatch.setenv("AUTOEVOLVE_PROGRESS_EVERY", "soon")
    with pytest.raises(ValueError, match="AUTOEVOLVE_PROGRESS_EVERY='soon' is no number of seconds"):
        narration.print_progress("every", 1, 2)
