"""Settlement, the spec's Recovery: member reports -> the verdict (clusters.verdict) -> every
member settled.

A member's report (or its loss with its worker) releases its row without moving its job. The
first deciding report resolves the attempt and, in the same transaction, the verdict closes
it, moves the cluster and each member's job through their guarded writes. Later reports find
their rows settled and change nothing.
"""

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from clusters import statements
from clusters.blame import Blame, blame_for, blame_seats
from clusters.claim import (
    RELEASED_FROM,
    bound_lock_waits,
    close_cluster_attempt,
    lock_timeout_params,
)
from clusters.coordinator import abort_prepare, notify_abort
from clusters.models import CLUSTER_MACHINE, AttemptOutcome, ClusterAttempt, ClusterStatus
from clusters.verdict import (
    LOST,
    MemberState,
    Settlement,
    Verdict,
    budget_left,
    decide,
    member_moves,
)
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BUILD_TERMINAL,
    DISPATCHED_MACHINE,
    EVALUATION_TERMINAL,
    JOB_MACHINES,
    BuildStatus,
    DispatchedJob,
    DispatchedOutcome,
    EvaluationStatus,
    JobKind,
)
from gradient.jobs.transitions import move
from gradient.logs import ids
from gradient.postgresql.pipeline import send
from workers.statements import COUNT_SUCCESS_SQL

log = logging.getLogger(__name__)

ATTEMPT_OUTCOME = {
    Verdict.COMPLETE: AttemptOutcome.SUCCEEDED,
    Verdict.RETRY: AttemptOutcome.FAILED,
    Verdict.FAIL: AttemptOutcome.FAILED,
    Verdict.ABORT: AttemptOutcome.ABORTED,
}
CLUSTER_STATUS = {
    Verdict.COMPLETE: ClusterStatus.COMPLETED,
    Verdict.RETRY: ClusterStatus.QUEUED,
    Verdict.FAIL: ClusterStatus.FAILED,
    Verdict.ABORT: ClusterStatus.ABORTED,
}


# A member row's outcomes the verdict reads; Abandoned (settled, or its prepare failed) and
# open rows report nothing.
REPORTED = frozenset({DispatchedOutcome.COMPLETED, DispatchedOutcome.FAILED})


@dataclass(frozen=True)
class Member:
    """A member's dispatched_job row, as the verdict reads it and settling moves its job."""

    id: uuid.UUID
    job_id: str
    worker_id: int
    evaluation_id: uuid.UUID | None
    derivation_build_id: uuid.UUID | None
    finished_at: datetime | None
    outcome: str | None
    failure_kind: str | None
    primary: bool
    dead: bool
    aborted: bool

    @classmethod
    def lost(cls, job_id, evaluation_id, build_id, primary, dead, aborted) -> "Member":
        """A member whose row closed without a verdict: it counts as lost with its worker."""
        return cls(
            None,
            job_id,
            None,
            evaluation_id,
            build_id,
            timezone.now(),
            DispatchedOutcome.FAILED,
            LOST,
            primary,
            dead,
            aborted,
        )

    @property
    def state(self) -> MemberState:
        outcome = self.outcome if self.outcome in REPORTED else None
        return MemberState(
            self.job_id, self.primary, outcome, self.failure_kind, self.dead, self.aborted
        )


@dataclass(frozen=True)
class Attempt:
    """An attempt under its lock, with its members, as VERDICT_INPUT_SQL reads them."""

    id: uuid.UUID
    cluster_id: int
    started: bool
    closed: bool
    budget_left: bool
    members: list[Member]

    @classmethod
    def from_rows(cls, rows) -> "Attempt":
        attempt_id, cluster_id, started, closed, attempts, budget = rows[0][:6]
        members = [Member(*row[6:]) for row in rows]
        return cls(attempt_id, cluster_id, started, closed, budget_left(attempts, budget), members)


# The job statuses the members' SQL reads as dead (final) and as aborted.
MEMBER_STATUSES = {
    "dead": sorted(EVALUATION_TERMINAL | BUILD_TERMINAL),
    "aborted": sorted({EvaluationStatus.ABORTED, BuildStatus.ABORTED}),
}


# Where a settlement sends a member's job: (build status, evaluation status).
SETTLED_STATUS = {
    Settlement.COMPLETED: (BuildStatus.COMPLETED, EvaluationStatus.COMPLETED),
    Settlement.REQUEUED: (BuildStatus.QUEUED, EvaluationStatus.QUEUED),
    Settlement.FAILED: (BuildStatus.FAILED_PERMANENT, EvaluationStatus.FAILED),
    Settlement.ABORTED: (BuildStatus.ABORTED, EvaluationStatus.ABORTED),
}


def _job_moves(verdict: Verdict, members: list[Member]) -> dict[str, list[tuple]]:
    """(job, target, expected sources) per member job, by kind, as verdict.member_moves says."""
    settlements = member_moves(verdict, [m.state for m in members])
    moves: dict[str, list[tuple]] = {kind: [] for kind in JOB_MACHINES}
    for m in members:
        settlement = settlements[m.job_id]
        to_build, to_eval = SETTLED_STATUS[settlement]
        if m.derivation_build_id:
            kind, job, to = JobKind.BUILD, m.derivation_build_id, to_build
        elif m.evaluation_id:
            kind, job, to = JobKind.EVAL, m.evaluation_id, to_eval
        else:
            continue  # its job is gone
        # Requeued: only from where the attempt held it (never a job that ended meanwhile).
        expect = RELEASED_FROM[kind] if settlement == Settlement.REQUEUED else None
        moves[kind].append((job, to, expect))
    return moves


def settle(attempt_id, cluster_id, verdict: Verdict, members: list[Member]) -> list[int] | None:
    """Apply a decided verdict in the caller's transaction, the attempt (or, without one, the
    cluster) locked: the attempt closed, the cluster moved, every member's job settled. The
    survivors' workers, to be told AbortCluster after commit; None, having settled nothing, when
    the cluster's machine refuses the move."""
    survivors = sorted({m.worker_id for m in members if m.finished_at is None})
    now = timezone.now()
    if attempt_id is None:
        moved = move(CLUSTER_MACHINE, [cluster_id], CLUSTER_STATUS[verdict], at=now)
    else:
        moved = close_cluster_attempt(
            attempt_id, ATTEMPT_OUTCOME[verdict], now, cluster_status=CLUSTER_STATUS[verdict]
        )
    if not moved:
        log.error("cluster %s cannot be moved to %s", cluster_id, CLUSTER_STATUS[verdict])
        return None
    with connection.wrap_database_errors, connection.connection.pipeline():
        for kind, moves in _job_moves(verdict, members).items():
            if moves:
                send(statements.MOVE_SQL[kind], JOB_MACHINES[kind].bind_each("jobs", moves))
    log.info(
        "cluster %s decided %s (attempt %s)",
        cluster_id,
        verdict,
        attempt_id,
        extra=ids(cluster=cluster_id, attempt=attempt_id),
    )
    return survivors


def _record_report(
    worker_id, job_id, assignment_id, outcome, kind, output: dict
) -> tuple[Attempt, bool] | None:
    """The report's statements up to the verdict, in one round trip: the attempt locked, the row
    finished with its `output` if it may be. None when the assignment is no member's held by this
    worker; else the attempt as they left it and whether the row finished."""
    params = {
        "id": assignment_id,
        "worker": worker_id,
        "job": job_id,
        "kind": kind,
        **output,
        "completed": DispatchedOutcome.COMPLETED,
        **lock_timeout_params(),
        **DISPATCHED_MACHINE.bind("finish", outcome, at=timezone.now()),
        **MEMBER_STATUSES,
    }
    with connection.wrap_database_errors, connection.connection.pipeline():
        send(statements.BOUND_MEMBER_LOCK_WAITS_SQL, params)
        send(statements.LOCK_ATTEMPT_SQL, params)
        finish = send(statements.FINISH_REPORTED_SQL, params)
        if outcome == DispatchedOutcome.COMPLETED:
            send(COUNT_SUCCESS_SQL, params)
        members = send(statements.REPORTED_MEMBERS_SQL, params)
    rows = members.fetchall()
    if not rows:
        return None
    return Attempt.from_rows(rows), finish.fetchone() is not None


def _refuse_unless_settled(attempt: Attempt, assignment_id, job_id: str) -> None:
    """A report that finished nothing: accepted for a row the verdict settled, else NotAllowed."""
    row = next(m for m in attempt.members if str(m.id) == str(assignment_id))
    if row.finished_at is None:
        raise NotAllowed(f"{job_id} must not run before StartCluster")
    if not (attempt.closed and row.outcome == DispatchedOutcome.ABANDONED):
        raise NotAllowed(f"{job_id} was reported already")


def keep_late_output(assignment_id, output: dict) -> None:
    """A survivor's report after the verdict settled its row: its error and log tail kept if the
    row has none, to show how it ended."""
    if output["error"] is not None or output["log_tail"] is not None:
        late = DispatchedJob.objects.filter(pk=assignment_id, error=None, log_tail=None)
        late.update(**output)


def _resolve(attempt: Attempt, *, aborted: bool = False) -> tuple[Verdict | None, list[int]]:
    """The verdict of the reports so far, settled when there is one; the survivors."""
    states = [m.state for m in attempt.members]
    verdict = decide(states, budget_left=attempt.budget_left, aborted=aborted)
    if verdict is None:
        return None, []
    survivors = settle(attempt.id, attempt.cluster_id, verdict, attempt.members)
    return (None, []) if survivors is None else (verdict, survivors)


def member_report(
    worker_id: int,
    job_id: str,
    assignment_id,
    outcome: str,
    kind: str | None = None,
    *,
    error: str | None = None,
    log_tail: str | None = None,
    single: Callable[[], None] | None = None,
) -> Verdict | None:
    """A member's JobCompleted/JobFailed (or its loss, outcome Failed with kind "lost").

    Finishes its row without moving its job; the first deciding report resolves the attempt and
    settles every member, in the same transaction. Before the start a failure is a failed prepare.
    A late report keeps only its output. An assignment that is no member's is NotAllowed, or goes
    to `single` in the same transaction."""
    verdict, survivors = None, []
    output = {"error": error, "log_tail": log_tail}
    with transaction.atomic(durable=True):
        recorded = _record_report(worker_id, job_id, assignment_id, outcome, kind, output)
        if recorded is None:
            if single is None:
                raise NotAllowed(
                    f"{job_id} is not a member held by this worker under {assignment_id}"
                )
            single()
            return None
        attempt, finished = recorded
        if not finished:
            _refuse_unless_settled(attempt, assignment_id, job_id)
            keep_late_output(assignment_id, output)
            return None
        blame = blame_for(kind)
        if attempt.started:
            verdict, survivors = _resolve(attempt)
            if verdict is not None and blame is not None:
                blame_seats(attempt.id, Blame(blame, assignment_id))
    if not attempt.started:
        abort_prepare(
            attempt.id,
            f"member {job_id} failed before the start ({kind})",
            None if blame is None else Blame(blame, assignment_id),
        )
    elif survivors:
        notify_abort(attempt.id, f"attempt decided: {verdict}", survivors)
    return verdict


def resolve_attempt(attempt_id, reason: str, *, aborted: bool = False) -> Verdict | None:
    """Ask the verdict about an open attempt without a report: a member job ended outside it (the
    sweep), or the cluster is `aborted`. None when there is no verdict, or it was closed."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        attempts = ClusterAttempt.objects.select_for_update()
        if not attempts.filter(pk=attempt_id, finished_at=None).exists():
            return None
        with connection.cursor() as cursor:
            cursor.execute(
                statements.ATTEMPT_MEMBERS_SQL, {"attempt": attempt_id, **MEMBER_STATUSES}
            )
            attempt = Attempt.from_rows(cursor.fetchall())
        verdict, survivors = _resolve(attempt, aborted=aborted)
    if verdict is not None:
        notify_abort(attempt_id, reason, survivors)
    return verdict


def abort_attempt(attempt_id, reason: str) -> bool:
    """The operator aborted the cluster: the open attempt's verdict is Abort, survivors end
    Aborted and are told. False if it was already closed."""
    return resolve_attempt(attempt_id, reason, aborted=True) == Verdict.ABORT
