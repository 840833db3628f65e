"""The JSON event feed and signed stream links (SPEC §8)."""

from __future__ import annotations

import msgspec


class FeedEvent(msgspec.Struct, kw_only=True):
    id: str
    type: str
    data: msgspec.Raw  # the status object as committed


class EventFeed(msgspec.Struct, kw_only=True):
    events: list[FeedEvent]
    next_cursor: str


class EventLink(msgspec.Struct, kw_only=True):
    url: str
    expires_in: int


class ServerSentEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One event of a ``text/event-stream`` (documentation of the stream's items)."""

    id: str | None = None
    event: str | None = None
    data: str | None = None
    retry: int | None = None
