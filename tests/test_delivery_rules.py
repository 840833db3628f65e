"""The webhook rulebook (``herald.delivery_rules``) on its own: plain values in, decisions out.

Whether each store applies these decisions is the store contract suite's part
(``tests/store_contract/``); here each rule is pinned down by hand-written expectations.
"""

from __future__ import annotations

import pytest

from herald import delivery_rules as rules
from herald.deliveries import Plan
from herald.delivery_rules import (
    ENDPOINT_DISABLE_AFTER_S,
    PROGRESS_INTERVAL_S,
    ROTATION_OVERLAP_S,
    EndpointState,
    KeyTimes,
    Placement,
    Settlement,
    Sibling,
)

AT = 1_000_000.0


def sib(version: int, status: str = "pending", *, type: str = "job.running", attempts: int = 0,
        scheduled_at: float = AT - 10, lease_until: float | None = None, job: str = "j") -> Sibling:
    return Sibling(event_id=f"evt_{job}.{version}", version=version, type=type, status=status, attempts=attempts,
                   scheduled_at=scheduled_at, lease_until=lease_until)


def place(siblings: list[Sibling], version: int, type: str = "job.succeeded") -> Placement | None:
    return rules.place(siblings, event_id=f"evt_j.{version}", version=version, type=type, at=AT)


# ----- placement ------------------------------------------------------------------------------


def test_a_first_event_is_pending_now() -> None:
    assert place([], 1) == Placement("pending", AT)
    assert place([], 1).next_attempt_at == AT  # type: ignore[union-attr]


def test_a_redelivered_event_is_not_placed_again() -> None:
    assert place([sib(1), sib(2, "delivered", attempts=1)], 2) is None


@pytest.mark.parametrize("newer", [
    sib(3, "delivered", attempts=1),                  # sent
    sib(3, "pending", attempts=1),                    # sent, waiting for a retry
    sib(3, "pending", lease_until=AT + 30),           # being sent now
    sib(3, "superseded", attempts=2),                 # sent, then superseded
], ids=["delivered", "retrying", "leased", "sent-then-superseded"])
def test_an_event_older_than_one_sent_is_superseded_at_once(newer: Sibling) -> None:
    placement = place([newer], 2)
    assert placement == Placement("superseded", AT)
    assert placement is not None and placement.next_attempt_at is None


@pytest.mark.parametrize("newer", [
    sib(3, "pending"),                                # waiting behind this one (the claim's order)
    sib(3, "pending", lease_until=AT - 1),            # its lease ran out, never attempted
    sib(3, "superseded"),                             # never sent
], ids=["waiting", "lease-expired", "superseded-unsent"])
def test_an_event_older_than_one_not_yet_sent_goes_first(newer: Sibling) -> None:
    assert place([newer], 2) == Placement("pending", AT)


def test_older_deliveries_that_only_wait_are_superseded() -> None:
    siblings = [
        sib(1, "pending", attempts=2),                               # waiting for a retry: stale
        sib(2, "pending", type="job.progress"),                      # waiting for its progress slot: stale
        sib(3, "pending"),                                           # never attempted: it goes first, kept
        sib(4, "pending", attempts=1, lease_until=AT + 30),          # being sent now: kept
        sib(5, "failed", attempts=3),                                # finished: kept
    ]
    assert place(siblings, 6) == Placement("pending", AT, supersede=(1, 2))


def test_a_newer_sibling_is_never_superseded() -> None:
    assert place([sib(5, "pending", type="job.progress")], 4) == Placement("pending", AT)


def test_progress_waits_for_its_slot_after_the_last_one_sent_or_to_be_sent() -> None:
    sent = sib(2, "delivered", type="job.progress", attempts=1, scheduled_at=AT - 0.25)
    assert place([sent], 3, "job.progress") == Placement("pending", AT - 0.25 + PROGRESS_INTERVAL_S)
    # long ago: now
    old = sib(2, "delivered", type="job.progress", attempts=1, scheduled_at=AT - 5)
    assert place([old], 3, "job.progress") == Placement("pending", AT)
    # the one it supersedes gives its slot back: the slot is the one before it
    waiting = sib(3, "pending", type="job.progress", scheduled_at=AT + 0.75)
    assert place([sent, waiting], 4, "job.progress") == Placement(
        "pending", AT - 0.25 + PROGRESS_INTERVAL_S, supersede=(3,))
    # ...but one superseded after an attempt did take its slot
    tried = sib(3, "superseded", type="job.progress", attempts=1, scheduled_at=AT + 0.5)
    assert place([sent, tried], 4, "job.progress") == Placement("pending", AT + 0.5 + PROGRESS_INTERVAL_S)
    # a slot held by one being sent now (not stale) counts
    out = sib(3, "pending", type="job.progress", lease_until=AT + 30, scheduled_at=AT - 0.5)
    assert place([out], 4, "job.progress") == Placement("pending", AT + 0.5)


def test_only_progress_waits_for_a_slot() -> None:
    sent = sib(2, "delivered", type="job.progress", attempts=1, scheduled_at=AT - 0.25)
    assert place([sent], 3, "job.succeeded") == Placement("pending", AT)


# ----- settlement -----------------------------------------------------------------------------

ENABLED = EndpointState("enabled", None)
RETRY = Plan("retry", delay_s=30.0)


def test_delivered_ends_the_failing_streak() -> None:
    failing = EndpointState("enabled", AT - 100)
    assert rules.settle(Plan("delivered"), ok=True, newer=True, endpoint=failing, at=AT) == Settlement(
        "delivered", None, None)


def test_a_retry_is_pending_after_the_plans_delay_and_starts_a_streak() -> None:
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=ENABLED, at=AT) == Settlement(
        "pending", AT + 30.0, AT)
    streak = EndpointState("enabled", AT - 100)
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=streak, at=AT).failing_since == AT - 100


def test_a_retry_with_a_newer_delivery_behind_it_is_superseded() -> None:
    assert rules.settle(RETRY, ok=False, newer=True, endpoint=ENABLED, at=AT) == Settlement("superseded", None, AT)


def test_a_failed_plan_fails_whatever_follows() -> None:
    assert rules.settle(Plan("failed"), ok=False, newer=True, endpoint=ENABLED, at=AT) == Settlement(
        "failed", None, AT)


def test_410_disables_the_endpoint() -> None:
    gone = Plan("failed", disable_endpoint=True)
    assert rules.settle(gone, ok=False, newer=False, endpoint=ENABLED, at=AT) == Settlement(
        "failed", None, AT, disable=True, endpoint_disabled=True)


def test_five_days_of_failing_disable_the_endpoint_and_fail_the_retry() -> None:
    long = EndpointState("enabled", AT - ENDPOINT_DISABLE_AFTER_S)
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=long, at=AT) == Settlement(
        "failed", None, AT - ENDPOINT_DISABLE_AFTER_S, disable=True, endpoint_disabled=True)
    almost = EndpointState("enabled", AT - ENDPOINT_DISABLE_AFTER_S + 1)
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=almost, at=AT).status == "pending"
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=long, at=AT, disable_after=2 * ENDPOINT_DISABLE_AFTER_S
                        ).status == "pending"


def test_a_failure_at_an_endpoint_disabled_meanwhile_fails_without_disabling_again() -> None:
    disabled = EndpointState("disabled", None)
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=disabled, at=AT) == Settlement(
        "failed", None, AT, disable=False, endpoint_disabled=True)
    assert rules.settle(Plan("delivered"), ok=True, newer=False, endpoint=disabled, at=AT) == Settlement(
        "delivered", None, None)


def test_callback_deliveries_have_no_endpoint_to_track() -> None:
    gone = Plan("failed", disable_endpoint=True)
    assert rules.settle(gone, ok=False, newer=False, endpoint=None, at=AT) == Settlement("failed", None, None)
    assert rules.settle(RETRY, ok=False, newer=False, endpoint=None, at=AT) == Settlement("pending", AT + 30.0, None)


@pytest.mark.parametrize("endpoint", [None, ENABLED, EndpointState("enabled", AT - 10), EndpointState("disabled", 1.0)])
@pytest.mark.parametrize("newer", [False, True])
def test_what_settles_alone_settles_the_same_whatever_the_store_holds(endpoint: EndpointState | None,
                                                                       newer: bool) -> None:
    assert rules.settles_alone(Plan("delivered"), ok=True)
    assert not rules.settles_alone(RETRY, ok=False) and not rules.settles_alone(Plan("failed"), ok=True)
    assert rules.settle(Plan("delivered"), ok=True, newer=newer, endpoint=endpoint, at=AT) == Settlement(
        "delivered", None, None)


# ----- keys -----------------------------------------------------------------------------------


def test_the_first_key_is_made_now() -> None:
    assert rules.rotate([], AT) == rules.Rotation(forget=(), retire=(), retire_at=AT + ROTATION_OVERLAP_S,
                                                  created_at=AT)


def test_a_rotation_retires_the_current_key_and_forgets_those_past_their_overlap() -> None:
    keys = [KeyTimes(AT - 90_000, AT - 10), KeyTimes(AT - 50_000, AT + 100), KeyTimes(AT - 20, None)]
    assert rules.rotate(keys, AT) == rules.Rotation(
        forget=(AT - 90_000,), retire=(AT - 20,), retire_at=AT + ROTATION_OVERLAP_S, created_at=AT)


def test_a_new_key_moves_forward_past_the_latest() -> None:
    assert rules.rotate([KeyTimes(AT, None)], AT).created_at == AT + rules.KEY_TIME_STEP_S
    assert rules.rotate([KeyTimes(AT + 5, None)], AT, overlap=60.0) == rules.Rotation(
        forget=(), retire=(AT + 5,), retire_at=AT + 60.0, created_at=AT + 5 + rules.KEY_TIME_STEP_S)


def test_the_keys_that_sign_are_the_unretired_newest_first() -> None:
    keys = [(KeyTimes(AT - 100, AT - 1), "forgotten"), (KeyTimes(AT - 50, AT + 10), "previous"),
            (KeyTimes(AT - 10, None), "current"), (KeyTimes(AT - 70, AT), "retired-just-now")]
    assert rules.signing_keys(keys, AT) == ["current", "previous"]
    assert rules.signing_keys(keys, AT + 10) == ["current"]
    assert rules.signing_keys([], AT) == []
