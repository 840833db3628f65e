"""The handler: run by workers only (``herald worker``), never imported by a gateway."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import msgspec

from schemas.problems import ProblemType
from workers import JobContext, JobFailed
from wordfreq.kinds import WordFreqParams

# A problem type of this kind's own: a failed job's ``error`` carries its type and title.
NO_WORDS = ProblemType("/problems/wordfreq-no-words", "No words left to count")

STEPS = 20  # progress is reported after each twentieth of the text
_WORD = re.compile(r"\w+(?:['’]\w+)*")
ENGLISH_STOPWORDS = frozenset(
    "a an and are as at be but by for from has have he her his i in is it its of on or she so that the their them "
    "they this to was we were will with you your".split()
)


class Entry(msgspec.Struct):
    word: str
    count: int
    share: float  # of every counted word


class Report(msgspec.Struct):
    """The JSON result (``GET /wordfreq/{id}``)."""

    words: int  # words counted
    distinct: int
    skipped: int  # stopwords and words shorter than min_length
    top: list[Entry]


def _count(part: str, params: WordFreqParams, counts: Counter[str]) -> int:
    skipped = 0
    for match in _WORD.finditer(part):
        word = match.group() if params.case_sensitive else match.group().lower()
        if len(word) < params.min_length or (params.stopwords == "en" and word.lower() in ENGLISH_STOPWORDS):
            skipped += 1
            continue
        counts[word] += 1
    return skipped


def _parts(text: str, steps: int) -> list[str]:
    """``text`` in about ``steps`` pieces, cut at whitespace so no word is split."""
    parts, start, size = [], 0, max(1, len(text) // steps)
    while start < len(text):
        end = min(len(text), start + size)
        while end < len(text) and not text[end].isspace():
            end += 1
        parts.append(text[start:end])
        start = end
    return parts


async def count_words(ctx: JobContext, params: WordFreqParams) -> Report:
    counts: Counter[str] = Counter()
    skipped = 0
    parts = _parts(params.text, STEPS)
    for done, part in enumerate(parts, start=1):
        await ctx.checkpoint()  # stops here if the client cancelled the job
        skipped += await asyncio.to_thread(_count, part, params, counts)  # CPU work off the event loop
        await ctx.progress(done * 100 // len(parts))
    total = sum(counts.values())
    if total == 0:
        raise JobFailed(NO_WORDS, f"all {skipped} words were stopwords or shorter than {params.min_length} letters")
    return Report(
        words=total,
        distinct=len(counts),
        skipped=skipped,
        top=[Entry(word, count, round(count / total, 4)) for word, count in counts.most_common(params.top)],
    )
