"""An incremental ``text/event-stream`` parser (the HTML Living Standard's algorithm).

Feed it bytes as they arrive, in chunks of any size; it returns the events completed by
each chunk. It does no I/O, so the sync and async clients share it.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SSEMessage:
    event: str
    data: str
    id: str | None  # the stream's last event id when this event was dispatched


class SSEDecoder:
    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._pending_cr = False
        self._event = ""
        self._data: list[str] = []
        self.last_event_id: str | None = None
        self.retry_ms: int | None = None
        self._first = True

    def feed(self, chunk: bytes) -> list[SSEMessage]:
        text = self._text.decode(chunk)
        if self._first and text:
            text = text.removeprefix("\ufeff")
            self._first = False
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across chunks
        self._pending_cr = False
        self._buffer += text
        messages: list[SSEMessage] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                break
            end, width = cut
            line = self._buffer[:end]
            if width == 1 and self._buffer[end] == "\r" and end + 1 == len(self._buffer):
                self._pending_cr = True  # a lone CR at the end: maybe half of CRLF
            self._buffer = self._buffer[end + width:]
            message = self._line(line)
            if message is not None:
                messages.append(message)
        return messages

    def _line(self, line: str) -> SSEMessage | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment (keep-alive)
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SSEMessage | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEMessage(event=event or "message", data="\n".join(data), id=self.last_event_id)


_LINE_END = re.compile(r"\r\n|\r|\n")


def _line_end(buffer: str) -> tuple[int, int] | None:
    """Index and width of the first line terminator (CRLF, LF or CR), if any."""
    match = _LINE_END.search(buffer)
    return (match.start(), match.end() - match.start()) if match else None
