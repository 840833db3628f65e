"""The declaration: what a gateway needs to accept, validate, document and serve ``wordfreq``
jobs. It imports only Herald's declaration types and msgspec: a gateway loads this module,
never the handler (``wordfreq.handler``) or anything the handler needs."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from herald.kinds import KindDeclaration
from schemas import JobParams


class WordFreqParams(JobParams, kw_only=True):
    """The request body of ``POST /wordfreq`` (unknown fields are refused with a 400)."""

    text: Annotated[str, msgspec.Meta(min_length=1, max_length=900_000, description="the text to count (UTF-8)")]
    top: Annotated[int, msgspec.Meta(ge=1, le=1000, description="how many of the most frequent words to list")] = 20
    min_length: Annotated[int, msgspec.Meta(ge=1, le=50, description="shorter words are not counted")] = 1
    stopwords: Annotated[
        Literal["none", "en"], msgspec.Meta(description="'en': leave out common English words (the, and, of...)")
    ] = "en"
    case_sensitive: bool = False


WORDFREQ = KindDeclaration(
    name="wordfreq",
    params=WordFreqParams,
    collection="/wordfreq",
    handler="wordfreq.handler:count_words",  # imported by workers only
    # The handler returns its report: stored and served as application/json (the default).
    deadline_s=600,
    max_attempts=2,
    concurrency=2,  # per worker process
    example={"text": "The quick brown fox jumps over the lazy dog. The dog sleeps.", "top": 5},
    description="Counts the words of a text and answers the most frequent ones, as JSON.",
)
