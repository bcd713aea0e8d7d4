"""A reply as it is generated: the text of each decode step, for a stream, and the client's leaving, for the decoder.

The fleet's worker calls ``take`` with each step's new tokens (from the decoder's thread); the server reads the
text pieces from ``pieces`` on its event loop. Text leaves only for a model call that can only be answered in text
(no tools offered); a call that may be a tool call is read whole at the end, as the reply's ``tool_calls``. Text
that may still become a stop sequence, or an unfinished UTF-8 character, is held back until the next tokens say.
When the client leaves (``cancel``) or a stop sequence appears, ``take`` answers False and the row ends at that
step.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any


class Live:
    """One streamed request's tokens as text pieces (see the module docstring)."""

    def __init__(
        self, tokenizer: Any, stops: list[str], loop: asyncio.AbstractEventLoop | None = None, stream: bool = True
    ) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.loop, self.stream = loop, stream  # not streamed: only the client's leaving is heard
        self.pieces: asyncio.Queue[str] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.model = ""  # the answering adapter, set when its call is made
        self.sent = ""  # the text that left so far
        self.first_token: float | None = None  # when the first token was generated (time.monotonic)
        self._ids: list[int] = []
        self._text_only = False

    def begin(self, model: str, text_only: bool) -> None:
        """A model call of this request starts: who answers, and whether its reply can only be text."""
        self.model, self._text_only, self._ids = model, text_only and self.stream, []

    def take(self, ids: list[int]) -> bool:
        """A decode step's new tokens; whether generation goes on."""
        if self.first_token is None:
            self.first_token = time.monotonic()
        if self.cancelled.is_set():
            return False
        if not self._text_only:
            return True
        self._ids += ids
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        end = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        ready = text[:end] if end >= 0 else _settled(text, self.stops)
        if len(ready) > len(self.sent) and ready.startswith(self.sent):
            self._put(ready[len(self.sent) :])
            self.sent = ready
        return end < 0

    def _put(self, piece: str) -> None:
        if self.loop is None:
            self.pieces.put_nowait(piece)
        else:
            self.loop.call_soon_threadsafe(self.pieces.put_nowait, piece)


def _settled(text: str, stops: list[str]) -> str:
    """The text that can leave now: without an unfinished character's replacement mark at its end, and without a
    tail that a stop sequence may begin with."""
    text = text.rstrip("\ufffd")
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]
