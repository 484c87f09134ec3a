"""Recovery sweeps: bring every cluster back to a consistent state from the database alone.

They find what no report will settle: overdue prepares, members lost with their worker,
attempts whose members' jobs ended outside them, Running clusters that lost their attempt.
Each step is one of settlement's or the claim module's re-checking transactions, so any number
of processes may sweep at once; deadlines come from stored times, so a restart resets none.
"""

import contextlib
import logging

from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from clusters import statements
from clusters.claim import bound_lock_waits
from clusters.coordinator import expire_overdue_prepares
from clusters.models import (
    ClusterJob,
    ClusterStatus,
    open_attempts,
)
from clusters.settlement import MEMBER_STATUSES, Member, member_report, resolve_attempt, settle
from clusters.verdict import LOST, Verdict, budget_left, decide
from gradient.errors import NotAllowed
from gradient.jobs.models import (
    BUILD_TERMINAL,
    EVALUATION_TERMINAL,
    DispatchedJob,
    DispatchedOutcome,
)
from workers.liveness import silent_before

log = logging.getLogger(__name__)


def resolve_orphaned_attempts(now=None) -> list:
    """Started attempts whose members are gone: a member job ended outside the attempt decides it
    (Abort if aborted, else Fail); a silent worker's member reports as lost."""
    now = now or timezone.now()
    silent = silent_before(now)
    with connection.cursor() as cursor:
        cursor.execute(
            statements.STARTED_WITH_LOST_OR_DEAD_SQL,
            {
                "dead_evals": sorted(EVALUATION_TERMINAL),
                "dead_builds": sorted(BUILD_TERMINAL),
                "silent": silent,
            },
        )
        rows = cursor.fetchall()
    resolved = []
    for attempt_id, dead, lost in rows:
        decided = dead and resolve_attempt(attempt_id, "a member's job ended outside the attempt")
        if not decided and lost:
            decided = _report_silent_members(attempt_id, silent)
        if decided:
            resolved.append(attempt_id)
    return resolved


def _report_silent_members(attempt_id, silent) -> bool:
    """Members whose worker is gone or silent report as lost into the verdict."""
    lost = DispatchedJob.objects.filter(
        Q(worker__channel_name__isnull=True) | Q(worker__last_seen_at__lt=silent),
        cluster_attempt_id=attempt_id,
        finished_at__isnull=True,
    ).values_list("pk", "worker_id", "job_id")
    decided = False
    for pk, worker_id, job_id in lost:
        with contextlib.suppress(NotAllowed):
            decided = (
                member_report(worker_id, job_id, pk, DispatchedOutcome.FAILED, LOST) is not None
                or decided
            )
    return decided


def settle_running_without_attempt() -> list:
    """A Running cluster without its started attempt (a crash between steps): every member reports
    as lost, and the verdict settles the cluster and its jobs."""
    stranded = ClusterJob.objects.filter(
        ~Exists(open_attempts(OuterRef("pk"))), status=ClusterStatus.RUNNING
    ).values_list("pk", flat=True)
    settled = []
    for cluster_id in stranded:
        with transaction.atomic(durable=True):
            bound_lock_waits()
            with connection.cursor() as cursor:
                params = {
                    "cluster": cluster_id,
                    "running": ClusterStatus.RUNNING,
                    **MEMBER_STATUSES,
                }
                cursor.execute(statements.STRANDED_MEMBERS_SQL, params)
                rows = cursor.fetchall()
            if not rows:
                continue  # claimed or settled meanwhile
            attempts, budget = rows[0][:2]
            members = [Member.lost(*row[2:]) for row in rows if row[2] is not None]
            states = [m.state for m in members]
            # Without members (deleted with their jobs) nothing can start again.
            verdict = decide(states, budget_left=budget_left(attempts, budget)) or Verdict.FAIL
            if settle(None, cluster_id, verdict, members) is not None:
                settled.append(cluster_id)
    return settled


def recover(now=None) -> dict:
    """Every sweep, in the order that lets each see the previous one's result."""
    result = {
        "expired": expire_overdue_prepares(now),
        "resolved": resolve_orphaned_attempts(now),
        "settled": settle_running_without_attempt(),
    }
    if any(result.values()):
        log.info("cluster recovery: %s", {k: len(v) for k, v in result.items()})
    return result


def report_lost_members(worker_id: int, keep=frozenset()) -> int:
    """The worker is gone: each of its open member rows but those in `keep` reports as lost into
    its attempt's verdict."""
    rows = (
        DispatchedJob.objects.filter(
            worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=False
        )
        .exclude(pk__in=keep)
        .values_list("pk", "job_id")
    )
    for pk, job_id in rows:
        with contextlib.suppress(NotAllowed):  # decided meanwhile
            member_report(worker_id, job_id, pk, DispatchedOutcome.FAILED, LOST)
    return len(rows)
