"""The spec's Claim and Close, and fail-prepare (the start is ACCEPT_SQL, the resolution
clusters.settlement).

Lock order, so that two of these never wait on each other in a circle: an existing attempt,
its dispatched_job rows, its cluster_job, the member jobs. A claim takes its seats first, by
(worker, kind), then its cluster (only to insert a new attempt, which waits on no existing
one), then its members by job key; a batch takes each step for all its clusters at once. A
close that blames seats locks their workers last, by id; a member's success locks its worker
after its own row.
"""

import json
import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from clusters import statements
from clusters.blame import Blame, blame_seats
from clusters.models import (
    ATTEMPT_MACHINE,
    CLUSTER_CLAIMABLE,
    CLUSTER_MACHINE,
    AttemptOutcome,
)
from gradient.jobs.claim import Assignment, claim_params
from gradient.jobs.models import (
    BUILD_MACHINE,
    DISPATCHED_MACHINE,
    BuildStatus,
    DispatchedJob,
    DispatchedOutcome,
    EvaluationStatus,
    JobKind,
)
from gradient.jobs.transitions import advance_builds, advance_evaluations
from gradient.postgresql.arrays import text_array
from gradient.postgresql.pipeline import send

log = logging.getLogger(__name__)


@dataclass
class ClusterClaim:
    cluster_id: int
    # One assignment per member, each with its own gate (job key and start condition).
    members: list[Assignment]
    attempt_id: uuid.UUID = field(default_factory=uuid.uuid4)
    now: datetime = field(default_factory=timezone.now)
    # The seats' idle slots (worker id, kind), taken in the same step: the claim is refused
    # when one is gone or older than `idle_since` (its worker went busy since the snapshot).
    idle_seats: list[tuple[int, str]] = field(default_factory=list)
    idle_since: datetime | None = None


class _Lost(Exception):
    """An attempt was opened but a member's claim inserted nothing (its job open elsewhere,
    or changed since the filter read it): the whole transaction rolls back."""


def lock_timeout_params() -> dict:
    return {"lock_timeout": str(int(settings.GRADIENT["CLAIM_LOCK_TIMEOUT_MS"]))}


def bound_lock_waits() -> None:
    with connection.cursor() as cursor:
        cursor.execute(statements.BOUND_LOCK_WAITS_SQL, lock_timeout_params())


def _claim(claims: list[ClusterClaim]) -> set[int]:
    """Claim every cluster of `claims` (disjoint) in one transaction; the clusters won. Raises
    _Lost when an opened attempt did not get its every member, build and seat."""
    claims = sorted(claims, key=lambda c: c.cluster_id)
    for claim in claims:
        for member in claim.members:
            member.cluster_attempt_id = claim.attempt_id
            member.dispatched_at = claim.now
    members = sorted((m for c in claims for m in c.members), key=lambda m: m.gate.key)
    seats = sorted(
        (w, k, c.idle_since.isoformat() if c.idle_since else None, c.cluster_id, c.attempt_id.hex)
        for c in claims
        for w, k in c.idle_seats
    )
    params = {
        "seats": json.dumps(
            [
                {"worker": w, "kind": k, "since": s, "cluster": c, "attempt": a}
                for w, k, s, c, a in seats
            ]
        ),
        "clusters": json.dumps(
            [
                {
                    "id": c.attempt_id.hex,
                    "cluster": c.cluster_id,
                    "created_at": c.now.isoformat(),
                    "seats": len(c.idle_seats),
                }
                for c in claims
            ]
        ),
        "claimable": sorted(CLUSTER_CLAIMABLE),
        "now": timezone.now(),  # a seat's worker quarantined since the snapshot is no seat
        **claim_params(members),
        "attempts": text_array(sorted({m.cluster_attempt_id.hex for m in members})),
        **BUILD_MACHINE.bind("assign", BuildStatus.BUILDING),
        **lock_timeout_params(),
    }
    with transaction.atomic(durable=True):
        with connection.wrap_database_errors, connection.connection.pipeline():
            send(statements.BOUND_LOCK_WAITS_SQL, params)
            opened = send(statements.OPEN_ATTEMPTS_SQL, params)
            claimed = send(statements.CLAIM_MEMBERS_SQL, params)
            assigned = send(statements.ASSIGN_BUILDS_SQL, params)
            taken = send(statements.TAKE_SEATS_SQL, params)
        won = {row[0] for row in opened.fetchall()}
        works = dict(claimed.fetchall())  # job key -> its work, for each member claimed
        builds = {row[0] for row in assigned.fetchall()}
        seats_taken = Counter(row[0] for row in taken.fetchall())
        for claim in claims:
            whole = (
                all(m.gate.key in works for m in claim.members)
                and all(m.gate.job in builds for m in claim.members if m.gate.kind == JobKind.BUILD)
                and seats_taken[claim.cluster_id] == len(claim.idle_seats)
            )
            if claim.cluster_id in won and not whole:
                raise _Lost(claim.cluster_id)
    for member in members:
        member.work = works.get(member.gate.key)
    return won


def claim_cluster(claim: ClusterClaim) -> bool:
    """Open an attempt and claim every member in one transaction; False writes nothing.

    The attempt is inserted only while the cluster is Queued and its seats idle; a member the
    single-assignment statement refuses (open elsewhere, or unable to start) rolls it all back.
    """
    if not claim.members:
        return False
    try:
        return claim.cluster_id in _claim([claim])
    except _Lost:
        return False
    except OperationalError as exc:
        # lock_timeout: a rival holds what we need; losing is the safe answer.
        log.warning("claim of cluster %s lost on a lock wait: %s", claim.cluster_id, exc)
        return False


def claim_clusters(claims: list[ClusterClaim]) -> list[bool]:
    """claim_cluster for each of many clusters, in one transaction and one round trip; whether
    each won. Should the batch fail as a whole, each claim goes again alone, so that only the one
    in the way loses.
    """
    if not _disjoint(claims):
        # Claims that share a cluster, a job or a seat decide against each other in order.
        return [claim_cluster(claim) for claim in claims]
    claimable = [c for c in claims if c.members]
    if not claimable:
        return [False] * len(claims)
    try:
        won = _claim(claimable)
    except _Lost as lost:
        log.info(
            "a batch of %d claims lost cluster %s after its attempt; claiming one by one",
            len(claims),
            lost,
        )
        return [claim_cluster(claim) for claim in claims]
    except OperationalError as exc:
        log.warning("a batch of %d claims failed (%s); claiming one by one", len(claims), exc)
        return [claim_cluster(claim) for claim in claims]
    return [c.cluster_id in won for c in claims]


def _disjoint(claims: list[ClusterClaim]) -> bool:
    clusters = [c.cluster_id for c in claims]
    keys = [m.gate.key for c in claims for m in c.members]
    seats = [seat for c in claims for seat in c.idle_seats]
    return all(len(set(xs)) == len(xs) for xs in (clusters, keys, seats))


def close_cluster_attempt(
    attempt_id, outcome: str, now: datetime | None = None, *, cluster_status: str | None = None
) -> int | None:
    """Close an open attempt with its outcome, abandoning its open member rows, and move its
    cluster to `cluster_status` if given, in one statement of the caller's transaction. The
    cluster's id, or None when the attempt was closed already (a second close touches nothing).
    """
    now = now or timezone.now()
    params = {
        "attempt": attempt_id,
        **ATTEMPT_MACHINE.bind("close", outcome, at=now),
        **DISPATCHED_MACHINE.bind("abandon", DispatchedOutcome.ABANDONED, at=now),
    }
    if cluster_status is not None:
        params.update(CLUSTER_MACHINE.bind("cluster", cluster_status, at=now))
    with connection.cursor() as cursor:
        cursor.execute(statements.CLOSE_ATTEMPT_SQL[cluster_status is not None], params)
        row = cursor.fetchone()
    return None if row is None else row[0]


def _member_jobs(attempt_id) -> tuple[list, list]:
    rows = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id)
    rows = list(rows.values_list("evaluation_id", "derivation_build_id"))
    return [e for e, _ in rows if e], [b for _, b in rows if b]


# What handing members back moves: builds still Building, evaluations still EvaluatingFlake.
RELEASED_FROM = {
    JobKind.BUILD: frozenset({BuildStatus.BUILDING}),
    JobKind.EVAL: frozenset({EvaluationStatus.EVALUATING_FLAKE}),
}


def release_members(attempt_id) -> None:
    """Hand the attempt's member jobs back to the queue."""
    evaluations, builds = _member_jobs(attempt_id)
    advance_builds(builds, BuildStatus.QUEUED, RELEASED_FROM[JobKind.BUILD])
    advance_evaluations(evaluations, EvaluationStatus.QUEUED, RELEASED_FROM[JobKind.EVAL])


def fail_prepare_attempt(attempt_id, blame: Blame | None = None) -> bool:
    """The spec's fail-prepare, one transaction: the unstarted attempt closed PrepareFailed, its
    builds handed back and the seat that failed it blamed. Its cluster is still Queued (it goes
    Running only at the start), so nothing is written to it. False if the attempt had started or
    was closed already."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        if close_cluster_attempt(attempt_id, AttemptOutcome.PREPARE_FAILED):
            release_members(attempt_id)
            if blame is not None:
                blame_seats(attempt_id, blame)
            return True
    return False
