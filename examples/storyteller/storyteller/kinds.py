"""The declaration of ``storyteller``: all a gateway needs (never the handler)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from herald.kinds import KindDeclaration
from schemas import JobParams


class StoryParams(JobParams, kw_only=True):
    """The request body of ``POST /stories``."""

    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=2000, description="what the story is about")]
    words: Annotated[int, msgspec.Meta(ge=1, le=5000, description="how many words to write")] = 60
    words_per_s: Annotated[float, msgspec.Meta(gt=0, le=1000, description="the writing speed, like a model's tokens/s")] = 20.0


STORYTELLER = KindDeclaration(
    name="storyteller",
    params=StoryParams,
    collection="/stories",
    handler="storyteller.handler:tell",  # imported by workers only
    deadline_s=900,
    concurrency=8,
    example={"prompt": "a lighthouse keeper who collects clocks", "words": 40, "words_per_s": 10},
    description="Writes a short text about the prompt, streaming each word as it is written "
    "(GET /jobs/{id}/output); the whole text is the JSON result.",
)
