"""Recovery sweeps: bring every cluster back to a consistent state from the database alone.

The sweeps find what no report will settle: members lost with their worker, attempts whose
members' jobs ended outside them (an abort never confirmed), Running clusters that lost their
attempt in a crash, and, first, the overdue prepares. Safe to run at start-up and at any time,
from any number of processes at once: each step is one of settlement's or the claim module's
transactions, which re-check what they change. Deadlines are computed from stored times (an
attempt's created_at), so a restart never resets one.
"""

import contextlib
import logging

from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from clusters.claim import bound_lock_waits
from clusters.coordinator import expire_overdue_prepares
from clusters.models import (
    ATTEMPT_IS_OPEN_SQL,
    ClusterJob,
    ClusterStatus,
    no_open_attempt_sql,
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
from gradient.wire.keys import member_key_sql
from workers.liveness import silent_before

log = logging.getLogger(__name__)


MEMBER_KEY = member_key_sql("m.evaluation_id", "m.derivation_build_id")
# Each open started attempt's members are aggregated in a subquery of their own, which
# PostgreSQL cannot flatten: joined flat, it hash-joined every member of the history kept.
STARTED_WITH_LOST_OR_DEAD_SQL = f"""
SELECT a.id, s.dead, s.lost
FROM cluster_attempt a
CROSS JOIN LATERAL (
    SELECT bool_or(e.status = ANY(%(dead_evals)s) OR b.status = ANY(%(dead_builds)s)) AS dead,
           bool_or(d.id IS NULL OR w.channel_name IS NULL OR w.last_seen_at < %(silent)s)
               AS lost
    FROM cluster_member m
    LEFT JOIN evaluation e ON e.id = m.evaluation_id
    LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
    LEFT JOIN dispatched_job d ON d.cluster_attempt_id = a.id AND d.finished_at IS NULL
        AND d.job_id = {MEMBER_KEY}
    LEFT JOIN worker w ON w.id = d.worker_id
    WHERE m.cluster_job_id = a.cluster_job_id
) s
WHERE {ATTEMPT_IS_OPEN_SQL} AND a.started_at IS NOT NULL
"""


def resolve_orphaned_attempts(now=None) -> list:
    """Started attempts whose members are gone resolve through the verdict: a member job
    that reached a final state outside the attempt decides it (Abort for an aborted job,
    else Fail), even when its worker never confirms; a member whose worker went silent
    reports as lost."""
    now = now or timezone.now()
    silent = silent_before(now)
    with connection.cursor() as cursor:
        cursor.execute(
            STARTED_WITH_LOST_OR_DEAD_SQL,
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


# A cluster's members as the verdict reads a lost one, the cluster locked; no rows once it
# has an open attempt or is no longer Running.
STRANDED_MEMBERS_SQL = f"""
WITH c AS (
    SELECT id, attempts, retry_budget FROM cluster_job
    WHERE id = %(cluster)s AND status = %(running)s
      AND {no_open_attempt_sql("%(cluster)s")}
    FOR UPDATE
)
SELECT c.attempts, c.retry_budget,
       {MEMBER_KEY},
       m.evaluation_id, m.derivation_build_id, m."primary",
       coalesce(e.status, b.status) = ANY(%(dead)s),
       coalesce(e.status, b.status) = ANY(%(aborted)s)
FROM c
LEFT JOIN cluster_member m ON m.cluster_job_id = c.id
LEFT JOIN evaluation e ON e.id = m.evaluation_id
LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
ORDER BY 3
"""


def settle_running_without_attempt() -> list:
    """A Running cluster always has a started, open attempt. One without it (a crash between
    processes' steps) lost every member without a verdict: each reports as lost, and the
    verdict settles the cluster and its member jobs as it would an attempt's."""
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
                cursor.execute(STRANDED_MEMBERS_SQL, params)
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
    """The worker is gone: each of its open member rows, but for those in `keep` (assignment
    ids it still runs), reports into its attempt's verdict (a failed prepare before the
    start)."""
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
