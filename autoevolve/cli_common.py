"""What every ``autoevolve`` command shares: the default store, the refusal that becomes one line on stderr and an
exit code, argument parsers for whole numbers, and the check that a store to read exists."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from autoevolve.store.postgres import is_url

DEFAULT_STORE = "trajectories/autoevolve.duckdb"


class CommandError(Exception):
    """What a command refuses (exit 2: the input is wrong) or fails on (exit 1): one line on stderr."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def refusing(*kinds: type[BaseException], code: int = 2, prefix: str = "") -> Iterator[None]:
    """Turn these exceptions into a CommandError with their message (a KeyError's without its quotes)."""
    try:
        yield
    except kinds as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise CommandError(f"{prefix}{text}", code) from None


def whole(least: int, below: str) -> Callable[[str], int]:
    """An argument's parser: a whole number of at least ``least`` (``below`` says why a smaller one is refused)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} {below}")
        return value

    return parse


positive = whole(1, "is too few: give 1 or more")
tier = whole(0, "is below 0: 0 is the entry expert, 1+ the experts it routes to")  # an expert's tier


def store_file(path: str, otherwise: str = "") -> None:
    """A read command's store must exist (it is never created by reading)."""
    if not is_url(path) and not Path(path).is_file():
        raise CommandError(
            f"no store at {path} (pass --store with an existing store's path; a run creates one{otherwise})"
        )
