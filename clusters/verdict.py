"""The spec's verdict, as a pure function: what the reports so far decide for an attempt.

The first deciding report resolves the attempt; the verdict then settles every member.
"""

from dataclasses import dataclass
from enum import StrEnum

# A permanent failure cannot succeed on a retry: the member can no longer start.
FINAL_FAILURES = frozenset({"permanent"})
# Failures that were an abort or a cancel: their job ends Aborted, not failed.
ABORTING_FAILURES = frozenset({"aborted", "canceled"})


class Verdict(StrEnum):
    COMPLETE = "Complete"
    RETRY = "Retry"
    FAIL = "Fail"
    ABORT = "Abort"


@dataclass(frozen=True)
class MemberState:
    key: str
    primary: bool
    # "Completed", "Failed" (reported or lost with its worker), or None while it runs.
    outcome: str | None
    failure_kind: str | None = None
    # Its evaluation or build reached a final state outside the attempt (cancel, removal).
    dead: bool = False


def decide(members: list[MemberState], *, budget_left: bool, aborted: bool = False):
    """The verdict the members' states decide, or None while the attempt must go on."""
    if aborted:
        return Verdict.ABORT
    failed = [m for m in members if m.outcome == "Failed"]
    if failed:
        can_start = not any(m.dead or m.failure_kind in FINAL_FAILURES for m in members)
        return Verdict.RETRY if budget_left and can_start else Verdict.FAIL
    done = [m for m in members if m.outcome == "Completed"]
    if len(done) == len(members) or any(m.primary for m in done):
        return Verdict.COMPLETE
    return None
