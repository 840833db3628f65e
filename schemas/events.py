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
