"""Job and delivery ids (``herald.ids``): UUIDv7 with 74 random bits (SPEC §2), in time order."""

from __future__ import annotations

import time
import uuid

from herald.ids import new_id, uuid7

RANDOM_BITS = [*range(0, 62), *range(64, 76)]  # rand_b, rand_a


def test_an_id_is_a_version_7_uuid_with_the_time_first() -> None:
    before = time.time_ns() // 1_000_000
    made = uuid.UUID(new_id())
    after = time.time_ns() // 1_000_000
    assert made.version == 7 and made.variant == uuid.RFC_4122
    assert before <= made.int >> 80 <= after
    assert str(made) == str(made).lower() and len(str(made)) == 36


def test_ids_of_one_millisecond_differ_in_74_random_bits_and_nowhere_else() -> None:
    ids = [uuid7(at_ms=1_764_633_600_000).int for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    varying = {bit for bit in range(128) if len({(i >> bit) & 1 for i in ids}) == 2}
    assert varying == set(RANDOM_BITS), "not 74 random bits, or a fixed field varies"


def test_ids_made_later_sort_after_earlier_ones_as_text() -> None:
    earlier = [str(uuid7(at_ms=1_764_633_600_000 + n)) for n in range(0, 50)]
    assert sorted(earlier) == earlier
