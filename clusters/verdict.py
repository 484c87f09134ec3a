"""The spec's verdict, as pure functions: what the reports so far decide for an attempt, and
where each member's job goes once it is decided."""

from dataclasses import dataclass
from enum import StrEnum

from gradient.jobs.models import DispatchedOutcome

# Failure kinds after which the same job may succeed on another try (protocol.md's kinds).
REQUEUEING_FAILURES = frozenset(
    {"transient", "timeout", "substitute_unavailable", "inputs_unavailable", "corrupt_eval_cache"}
)
# A member lost with its worker (a disconnect, a liveness timeout) reports this kind. A single
# job lost that way goes back to the queue, so for settling it is a requeueing kind too.
LOST = "lost"
# A permanent failure cannot succeed on a retry: the member can no longer start.
FINAL_FAILURES = frozenset({"permanent"})
# The worker's own abort or cancel: its job ends Aborted, not failed. Reported without an
# evaluation abort behind it (the member's job not Aborted), it is a failure like the others.
ABORTING_FAILURES = frozenset({"aborted", "canceled"})


class Verdict(StrEnum):
    COMPLETE = "Complete"
    RETRY = "Retry"
    FAIL = "Fail"
    ABORT = "Abort"


class Settlement(StrEnum):
    """Where a member's job goes once its attempt is decided."""

    COMPLETED = "Completed"
    # Back to the assignment passes.
    REQUEUED = "Requeued"
    # For good: a build FailedPermanent, an evaluation Failed.
    FAILED = "Failed"
    ABORTED = "Aborted"


@dataclass(frozen=True)
class MemberState:
    key: str
    primary: bool
    # "Completed", "Failed" (reported or lost with its worker), or None while it runs.
    outcome: str | None
    failure_kind: str | None = None
    # Its evaluation or build reached a final state outside the attempt (cancel, removal).
    dead: bool = False
    # Its evaluation or build was aborted: an evaluation abort reached the member.
    aborted: bool = False


def decide(members: list[MemberState], *, budget_left: bool, aborted: bool = False):
    """The verdict the members' states decide, or None while the attempt must go on. `aborted`:
    the operator aborted the cluster, an evaluation abort reaching every member."""
    if aborted or any(m.aborted for m in members):
        return Verdict.ABORT
    if any(m.dead or m.failure_kind in FINAL_FAILURES for m in members):
        return Verdict.FAIL  # a member can no longer start
    if any(m.outcome == DispatchedOutcome.FAILED for m in members):
        return Verdict.RETRY if budget_left else Verdict.FAIL
    done = [m for m in members if m.outcome == DispatchedOutcome.COMPLETED]
    if done and (len(done) == len(members) or any(m.primary for m in done)):
        return Verdict.COMPLETE
    return None


def budget_left(attempts: int, retry_budget: int) -> bool:
    """Retries so far are the started attempts but the first (a failed prepare starts none)."""
    return attempts - 1 < retry_budget


def member_moves(verdict: Verdict, members: list[MemberState]) -> dict[str, Settlement]:
    """Where the verdict sends each member's job, by member key, those still running included:
    their reports after the verdict change nothing."""
    return {m.key: _settlement(verdict, m) for m in members}


def _settlement(verdict: Verdict, m: MemberState) -> Settlement:
    if verdict == Verdict.RETRY:
        return Settlement.REQUEUED
    if m.outcome == DispatchedOutcome.COMPLETED:
        return Settlement.COMPLETED
    if m.outcome == DispatchedOutcome.FAILED and m.failure_kind not in ABORTING_FAILURES:
        return Settlement.FAILED  # its own outcome, made permanent
    return Settlement.ABORTED  # a survivor, or a member that reported its own abort
