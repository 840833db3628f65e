"""The handler: writes words at a steady rate and streams each one as it goes (SPEC §8).

It stands in for a model generating tokens: each word is one output chunk (a JSON string),
emitted with ``ctx.emit_nowait`` so the writing never waits on a round trip to NATS; the
worker stores every chunk before the job ends. The whole text is the job's JSON result.
"""

from __future__ import annotations

import asyncio
import random

import msgspec

from storyteller.kinds import StoryParams
from workers import JobContext

_VOCABULARY = (
    "the night was long and the sea kept its own counsel while somewhere a bell rang twice "
    "for nobody in particular and every clock in the tower agreed on a different hour"
).split()


class Story(msgspec.Struct):
    prompt: str
    text: str
    words: int


async def tell(ctx: JobContext, params: StoryParams) -> Story:
    # Seeded by the prompt: the same prompt writes the same text (a re-run attempt repeats it).
    rng = random.Random(params.prompt)
    prompt_words = params.prompt.split()
    pause = 1.0 / params.words_per_s
    written: list[str] = []
    for index in range(params.words):
        word = rng.choice(prompt_words if rng.random() < 0.25 else _VOCABULARY)
        chunk = word if index == 0 else " " + word
        written.append(chunk)
        ctx.emit_nowait(chunk)
        if index % 10 == 9:
            await ctx.progress((index + 1) * 100 // params.words)
        await asyncio.sleep(pause)
    return Story(prompt=params.prompt, text="".join(written), words=params.words)
