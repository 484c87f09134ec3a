"""The spec's Prepare and Start, and Signals: acceptances, rejections, held members' failures,
the prepare timeout, StartCluster with the roster, AbortCluster, and forwarding ClusterSignal.
Every decision is a transaction that re-reads its rows; frames go out after its commit."""

import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from clusters import statements
from clusters.blame import PREPARE_TIMEOUT, REJECTED, Blame
from clusters.book import role_indexes
from clusters.claim import fail_prepare_attempt, lock_timeout_params
from clusters.models import (
    ATTEMPT_IS_OPEN,
    ATTEMPT_MACHINE,
    ATTEMPT_STARTED,
    CLUSTER_MACHINE,
    ClusterAttempt,
    ClusterMember,
    ClusterStatus,
)
from gradient import metrics
from gradient.errors import NotAllowed
from gradient.jobs.models import EVALUATION_MACHINE, DispatchedJob, EvaluationStatus
from gradient.logs import ids
from gradient.wire.groups import send_frames
from gradient.wire.protocol import (
    AbortCluster,
    ForwardedSignal,
    MemberRef,
    RosterEntry,
    StartCluster,
)

log = logging.getLogger(__name__)


def _seats(attempt_id) -> list[tuple[DispatchedJob, str, int]]:
    """The attempt's rows with each member's (role, index), in roster order."""
    rows = list(
        DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).select_related("worker")
    )
    cluster_id = ClusterAttempt.objects.values_list("cluster_job_id", flat=True).get(pk=attempt_id)
    indexes = role_indexes(ClusterMember.objects.filter(cluster_job_id=cluster_id))
    seats = [(row, *indexes.get(row.job_id, ("?", 0))) for row in rows]
    return sorted(seats, key=lambda s: (s[1], s[2]))


# The start's three moves; the evaluations only from Queued, where the claim left them.
START_PARAMS = {
    **ATTEMPT_MACHINE.bind("start", ATTEMPT_STARTED),
    **CLUSTER_MACHINE.bind("run", ClusterStatus.RUNNING),
    **EVALUATION_MACHINE.bind(
        "flake", EvaluationStatus.EVALUATING_FLAKE, expect={EvaluationStatus.QUEUED}
    ),
}


def accept_assignment(worker_id: int, job_id: str) -> bool | None:
    """An AssignJobResponse(accepted): None for a single job. A member's acceptance is recorded;
    True when it was the last, which starts the attempt and sends StartCluster to every member."""
    params = {
        "worker": worker_id,
        "job": job_id,
        **lock_timeout_params(),
        **START_PARAMS,
    }
    with connection.cursor() as cursor:
        cursor.execute(statements.ACCEPT_SQL, params)
        rows = cursor.fetchall()
    if not rows:
        raise NotAllowed(f"{job_id} was not assigned to this worker")
    attempt_id, accepted = rows[0][:2]
    if attempt_id is None:
        return None
    if not accepted:
        raise NotAllowed(f"{job_id} is not held by this worker")
    if rows[0][2] is None:  # not the last acceptance, or the attempt had started or closed
        return False
    _send_start(attempt_id, [row[2:] for row in rows])
    return True


def _send_start(attempt_id, seats) -> None:
    """StartCluster to every seat of the started attempt, `seats` in roster order (_seats)."""
    seats = sorted(seats, key=lambda s: (s[4], s[5]))
    roster = [
        RosterEntry(role=role, index=index, worker=name, zone=zone, endpoint=endpoint)
        for _, name, zone, endpoint, role, index in seats
    ]
    start = StartCluster(attempt=str(attempt_id), roster=roster)
    send_frames([(seat[0], start) for seat in seats])
    log.info(
        "attempt %s started with %d members",
        attempt_id,
        len(seats),
        extra=ids(attempt=attempt_id, worker=[seat[0] for seat in seats]),
    )


def abort_prepare(attempt_id, reason: str, blame: Blame | None = None) -> bool:
    """A reject, the prepare timeout, or a held member's failure: the attempt closes PrepareFailed
    and every member drops its hold. False when the attempt had started or closed already."""
    if not fail_prepare_attempt(attempt_id, blame):
        return False
    notify_abort(attempt_id, reason)
    log.info("attempt %s prepare failed: %s", attempt_id, reason, extra=ids(attempt=attempt_id))
    return True


def expire_overdue_prepares(now=None) -> list:
    """Unstarted attempts past their prepare deadline close PrepareFailed, as a reject would."""
    now = now or timezone.now()
    deadline = now - timedelta(seconds=settings.GRADIENT["CLUSTER_PREPARE_TIMEOUT_SECS"])
    overdue = ClusterAttempt.objects.filter(
        ATTEMPT_IS_OPEN, started_at__isnull=True, created_at__lt=deadline
    ).values_list("pk", flat=True)
    timeout = Blame(PREPARE_TIMEOUT)
    return [pk for pk in overdue if abort_prepare(pk, "prepare timed out", timeout)]


def notify_abort(attempt_id, reason: str, workers=None) -> None:
    """AbortCluster to the given workers, by default every worker seated in the attempt."""
    if workers is None:
        workers = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).values_list(
            "worker_id", flat=True
        )
    message = AbortCluster(attempt=str(attempt_id), reason=reason)
    send_frames([(w, message) for w in sorted(set(workers))])


def member_rejected(worker_id: int, job_id: str, reason: str | None) -> None:
    row = (
        DispatchedJob.objects.filter(
            worker_id=worker_id,
            job_id=job_id,
            finished_at__isnull=True,
            cluster_attempt__isnull=False,
        )
        .values("cluster_attempt_id", "id")
        .first()
    )
    if row is None:
        raise NotAllowed(f"{job_id} is not held by this worker")
    abort_prepare(
        row["cluster_attempt_id"],
        f"member {job_id} rejected: {reason or 'no reason'}",
        Blame(REJECTED, row["id"]),
    )


def forward_signal(worker_id: int, attempt: str, to: MemberRef | None, payload) -> int:
    """Forward a ClusterSignal within a started attempt, from one of its members, to the member
    named by `to` or else to every other member. Returns how many got it."""
    attempt_id = uuid.UUID(attempt)
    is_started = ClusterAttempt.objects.filter(
        ATTEMPT_IS_OPEN, pk=attempt_id, started_at__isnull=False
    ).exists()
    if not is_started:
        raise NotAllowed("signals are forwarded only within a started attempt")
    seats = [s for s in _seats(attempt_id) if s[0].finished_at is None]
    sender = next((s for s in seats if s[0].worker_id == worker_id), None)
    if sender is None:
        raise NotAllowed("only a member of the attempt can signal it")
    if to is None:
        targets = [s for s in seats if s is not sender]
    else:
        targets = [s for s in seats if (s[1], s[2]) == (to.role, to.index)]
        if not targets:
            raise NotAllowed(f"no member {to.role}/{to.index} in this attempt")
    message = ForwardedSignal(
        attempt=attempt, **{"from": MemberRef(role=sender[1], index=sender[2])}, payload=payload
    )
    send_frames([(row.worker_id, message) for row, _, _ in targets])
    metrics.count_signal_forwarded()
    return len(targets)
