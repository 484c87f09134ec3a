"""The spec's Claim and Close, and fail-prepare. The start is the last member's acceptance
(clusters.coordinator.ACCEPT_SQL), resolve a member's deciding report (clusters.settlement).

Lock order, so that two of these never wait on each other in a circle: an existing attempt
first, then its dispatched_job rows, then its cluster_job, then the member jobs. A claim
takes its seats first, in (worker, kind) order (claims of different clusters share seats,
never member jobs), then locks its cluster, but only to insert a new attempt, which conflicts
with no existing one (ON CONFLICT DO NOTHING returns at once), and claims its members in
job-key order. A batch of claims (claim_clusters) takes each step for all its clusters at
once, in the same order: the seats by (worker, kind), the clusters by id, the members by job
key, then the builds.
"""

import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from clusters.models import (
    ATTEMPT_MACHINE,
    CLUSTER_CLAIMABLE,
    CLUSTER_MACHINE,
    AttemptOutcome,
)
from gradient.jobs.claim import Assignment, claim_assignments
from gradient.jobs.models import (
    BUILD_MACHINE,
    DISPATCHED_MACHINE,
    EVALUATION_STARTABLE,
    BuildStatus,
    DispatchedOutcome,
    EvaluationStatus,
    JobKind,
)
from gradient.jobs.transitions import advance_builds, advance_evaluations

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
    """Raised inside the claim transaction to roll every statement back."""


def bound_lock_waits() -> None:
    # A frozen rival holding a row lock must cost this claimer a bounded wait, not a hang.
    ms = int(settings.GRADIENT["CLAIM_LOCK_TIMEOUT_MS"])
    with connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = {ms}")


OPEN_ATTEMPT_SQL = """
INSERT INTO cluster_attempt (id, cluster_job_id, created_at)
SELECT %s, %s, %s
WHERE EXISTS (SELECT 1 FROM cluster_job WHERE id = %s AND status = ANY(%s) FOR SHARE)
ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING id
"""


def claim_cluster(claim: ClusterClaim) -> bool:
    """Open an attempt and claim every member in one transaction; False writes nothing.

    The attempt is inserted only while the cluster is Queued, and idx-cluster_attempt-open
    makes a second claimer insert nothing. Each member then goes through the single-assignment
    claim; the first that inserts nothing (the job is open elsewhere, or cannot start) rolls
    the whole attempt back. Build members get their Assigned transition in the same step.
    """
    if not claim.members:
        return False
    try:
        with transaction.atomic(durable=True):
            bound_lock_waits()
            if claim.idle_seats and not _take_idle_seats(claim):
                raise _Lost
            with connection.cursor() as cursor:
                cursor.execute(
                    OPEN_ATTEMPT_SQL,
                    [
                        claim.attempt_id,
                        claim.cluster_id,
                        claim.now,
                        claim.cluster_id,
                        sorted(CLUSTER_CLAIMABLE),
                    ],
                )
                if cursor.fetchone() is None:
                    raise _Lost
            # Canonical key order: overlapping claimers queue on the same key first. The
            # members go in one round trip; any that inserts nothing loses the whole claim.
            members = sorted(claim.members, key=lambda m: m.gate.key)
            for member in members:
                member.cluster_attempt_id = claim.attempt_id
                member.dispatched_at = claim.now
            if not claim_assignments(members):
                raise _Lost
            builds = [m.gate.job for m in claim.members if m.gate.kind == JobKind.BUILD]
            if advance_builds(builds, BuildStatus.BUILDING, {BuildStatus.QUEUED}) != len(builds):
                raise _Lost
    except _Lost:
        return False
    except OperationalError as exc:
        # lock_timeout: a rival holds what we need; losing is the safe answer.
        log.warning("claim of cluster %s lost on a lock wait: %s", claim.cluster_id, exc)
        return False
    return True


# The batch statements below take their rows as one JSON document each: psycopg dumps a
# Python list element by element (a type lookup and a quoting check for each), which for the
# dozen arrays of a batch of 512 members cost more than the statements themselves;
# json.dumps is C, and PostgreSQL reads the rows with json_to_recordset.

# The seats of a batch, locked while they are live: the seats of a claim that wins are deleted
# as the batch commits, those of one that loses are left as they were.
LOCK_IDLE_SEATS_SQL = """
SELECT s.worker_id, s.kind FROM idle_slot s
JOIN json_to_recordset(%s::json) AS t(worker bigint, kind text, since timestamptz)
  ON s.worker_id = t.worker AND s.kind = t.kind
WHERE s.recorded_at >= t.since
ORDER BY s.worker_id, s.kind
FOR UPDATE OF s
"""

# Every cluster's attempt, inserted only while its cluster is Queued; idx-cluster_attempt-open
# makes a cluster with an open attempt insert nothing (OPEN_ATTEMPT_SQL, a row per cluster).
OPEN_ATTEMPTS_SQL = """
INSERT INTO cluster_attempt (id, cluster_job_id, created_at)
SELECT t.id, t.cluster, t.created_at
FROM json_to_recordset(%s::json) AS t(id uuid, cluster bigint, created_at timestamptz)
WHERE EXISTS (SELECT 1 FROM cluster_job c
              WHERE c.id = t.cluster AND c.status = ANY(%s) FOR SHARE)
ORDER BY t.cluster
ON CONFLICT (cluster_job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING cluster_job_id
"""

# The single-assignment claim statement (gradient.jobs.claim.CLAIM_SQL) over every member of
# a batch, a row each: its own job key, its own start condition (ClaimGate.condition: a build
# still Queued in the substitute mode seen, an evaluation not finished), its attempt. Rows go
# in job-key order; idx-dispatched_job-open-job makes a key open elsewhere insert nothing.
CLAIM_MEMBERS_SQL = """
INSERT INTO dispatched_job (
    id, kind, job_id, evaluation_id, derivation_build_id, worker_id, project_id, steps,
    dispatched_at, cluster_attempt_id, missing_nar_size
)
SELECT t.id, t.kind, t.job_id, t.evaluation_id, t.build_id, t.worker_id, t.project_id,
       string_to_array(t.steps, ','), t.dispatched_at, t.attempt_id, t.size
FROM json_to_recordset(%(rows)s::json)
     AS t(id uuid, kind text, job_id text, evaluation_id uuid, build_id uuid, worker_id bigint,
          project_id bigint, steps text, dispatched_at timestamptz, attempt_id uuid,
          size bigint, substitute bool)
WHERE CASE WHEN t.build_id IS NOT NULL
           THEN EXISTS (SELECT 1 FROM derivation_build b WHERE b.id = t.build_id
                        AND b.status = %(queued)s AND b.cache_available = t.substitute)
           ELSE EXISTS (SELECT 1 FROM evaluation e WHERE e.id = t.evaluation_id
                        AND e.status = ANY(%(startable)s))
      END
ORDER BY t.job_id
ON CONFLICT (job_id) WHERE finished_at IS NULL DO NOTHING
RETURNING job_id
"""

# The Assigned transition of the builds of a batch (their guarded write): which moved.
ASSIGN_BUILDS_SQL = BUILD_MACHINE.update(
    "assign", "id IN (SELECT json_array_elements_text(%(builds)s::json)::uuid)"
)


def claim_clusters(claims: list[ClusterClaim]) -> list[bool]:
    """claim_cluster for each of many clusters, in two round trips for them all; whether each
    won. Every claim still wins or loses on its own: one that loses writes nothing.

    One transaction for the batch, its statements sent without waiting for each other (a
    psycopg pipeline), one per step for every claim: lock the seats (not yet taken), open the
    attempts, claim the members (in job-key order), the builds' Assigned transition. A claim
    that lost any step (a seat gone or stale, its attempt or a member inserting nothing, a
    build no longer Queued) is then undone row by row in the same transaction, and the
    winners take their seats, before the one commit: nothing of a loser is ever visible to
    another transaction. Should the batch fail as a whole (a lock_timeout behind a frozen
    rival), each claim is retried alone, so that only the one in the way loses.
    """
    if not _disjoint(claims):
        # Claims that share a cluster, a job or a seat decide against each other in order.
        return [claim_cluster(claim) for claim in claims]
    claimable = [c for c in claims if c.members]
    if not claimable:
        return [False] * len(claims)
    try:
        won = _claim_batch(claimable)
    except OperationalError as exc:
        log.warning("a batch of %d claims failed (%s); claiming one by one", len(claims), exc)
        return [claim_cluster(claim) for claim in claims]
    return [c.cluster_id in won for c in claims]


def _disjoint(claims: list[ClusterClaim]) -> bool:
    clusters = [c.cluster_id for c in claims]
    keys = [m.gate.key for c in claims for m in c.members]
    seats = [seat for c in claims for seat in c.idle_seats]
    return all(len(set(xs)) == len(xs) for xs in (clusters, keys, seats))


def _member_rows(members: list[tuple[ClusterClaim, Assignment]]) -> str:
    """CLAIM_MEMBERS_SQL's rows, as JSON."""
    rows = []
    for claim, m in members:
        is_build = m.gate.kind == JobKind.BUILD
        job = str(m.gate.job)
        rows.append(
            {
                "id": m.id.hex,
                "kind": m.gate.kind,
                "job_id": m.gate.key,
                "evaluation_id": None if is_build else job,
                "build_id": job if is_build else None,
                "worker_id": m.worker_id,
                "project_id": m.project_id,
                "steps": ",".join(m.steps),
                "dispatched_at": claim.now.isoformat(),
                "attempt_id": claim.attempt_id.hex,
                "size": m.missing_nar_size,
                "substitute": m.gate.substitute,
            }
        )
    return json.dumps(rows)


def _claim_batch(claims: list[ClusterClaim]) -> set[int]:
    members = sorted(
        ((claim, m) for claim in claims for m in claim.members), key=lambda cm: cm[1].gate.key
    )
    for claim, member in members:
        member.cluster_attempt_id = claim.attempt_id
        member.dispatched_at = claim.now
    owner = {m.gate.key: claim.cluster_id for claim, m in members}
    seats = sorted({(w, k, c.cluster_id, c.idle_since) for c in claims for w, k in c.idle_seats})
    builds = {m.gate.job: c.cluster_id for c, m in members if m.gate.kind == JobKind.BUILD}
    ordered = sorted(claims, key=lambda c: c.cluster_id)
    ms = int(settings.GRADIENT["CLAIM_LOCK_TIMEOUT_MS"])
    with transaction.atomic(durable=True):
        pg = connection.connection  # (the atomic block opened it)

        def cursor():
            # Server-side binding: Django's own cursors quote every parameter into the text.
            return psycopg.Cursor(pg)

        with connection.wrap_database_errors:
            with pg.pipeline():
                cursor().execute(f"SET LOCAL lock_timeout = {ms}")
                seat_rows = cursor()
                if seats:
                    seat_rows.execute(
                        LOCK_IDLE_SEATS_SQL,
                        [
                            json.dumps(
                                [
                                    {"worker": w, "kind": k, "since": since.isoformat()}
                                    for w, k, _, since in seats
                                ]
                            )
                        ],
                    )
                attempt_rows = cursor()
                attempt_rows.execute(
                    OPEN_ATTEMPTS_SQL,
                    [
                        json.dumps(
                            [
                                {
                                    "id": c.attempt_id.hex,
                                    "cluster": c.cluster_id,
                                    "created_at": c.now.isoformat(),
                                }
                                for c in ordered
                            ]
                        ),
                        sorted(CLUSTER_CLAIMABLE),
                    ],
                )
                member_rows = cursor()
                member_rows.execute(
                    CLAIM_MEMBERS_SQL,
                    {
                        "rows": _member_rows(members),
                        "queued": BuildStatus.QUEUED.value,
                        "startable": sorted(s.value for s in EVALUATION_STARTABLE),
                    },
                )
                build_rows = cursor()
                build_rows.execute(
                    ASSIGN_BUILDS_SQL,
                    {
                        "builds": json.dumps(list(map(str, builds))),
                        **BUILD_MACHINE.bind("assign", BuildStatus.BUILDING),
                    },
                )
            live = set(seat_rows.fetchall()) if seats else set()
            opened = {row[0] for row in attempt_rows.fetchall()}
            claimed = {row[0] for row in member_rows.fetchall()}
            moved = {row[0] for row in build_rows.fetchall()}
            lost = {c for w, k, c, _ in seats if (w, k) not in live}
            lost |= {c.cluster_id for c in claims if c.cluster_id not in opened}
            lost |= {c for key, c in owner.items() if key not in claimed}
            lost |= {c for job, c in builds.items() if job not in moved}
            won = {c.cluster_id for c in claims} - lost
            with pg.pipeline():
                if lost:
                    _undo(cursor, [c for c in claims if c.cluster_id in lost], builds, moved)
                taken = [(w, k) for w, k, c, _ in seats if c in won]
                if taken:
                    cursor().execute(
                        "DELETE FROM idle_slot s"
                        " USING json_to_recordset(%s::json) AS t(worker bigint, kind text)"
                        " WHERE s.worker_id = t.worker AND s.kind = t.kind",
                        [json.dumps([{"worker": w, "kind": k} for w, k in taken])],
                    )
    return won


def _undo(cursor, losers: list[ClusterClaim], builds: dict, moved: set) -> None:
    """Remove what the losing claims of a batch wrote, inside its transaction."""
    attempt_ids = [c.attempt_id for c in losers]
    cluster_ids = {c.cluster_id for c in losers}
    cursor().execute("DELETE FROM dispatched_job WHERE cluster_attempt_id = ANY(%s)", [attempt_ids])
    cursor().execute("DELETE FROM cluster_attempt WHERE id = ANY(%s)", [attempt_ids])
    back = [job for job, c in builds.items() if c in cluster_ids and job in moved]
    if back:
        # The builds' guarded write: only a build this claim moved to Building goes back.
        cursor().execute(
            UNDO_BUILDS_SQL,
            {"ids": back, **BUILD_MACHINE.bind("undo", BuildStatus.QUEUED, {BuildStatus.BUILDING})},
        )


UNDO_BUILDS_SQL = BUILD_MACHINE.update("undo", "id = ANY(%(ids)s::uuid[])")


# A claim's seats, locked in (worker, kind) order and then deleted: two claims whose seats
# overlap, listed in any order, queue on the first seat they share instead of each holding
# one the other waits for. (Without the ORDER BY the lock order is the plan's, which for a
# fleet's idle_slot is an index probe per seat in the order the claim lists them.)
TAKE_IDLE_SEATS_SQL = """
WITH live AS MATERIALIZED (
    SELECT s.worker_id, s.kind FROM idle_slot s
    JOIN unnest(%s::bigint[], %s::text[]) AS t(worker, kind)
      ON s.worker_id = t.worker AND s.kind = t.kind
    WHERE s.recorded_at >= %s
    ORDER BY s.worker_id, s.kind
    FOR UPDATE OF s
)
DELETE FROM idle_slot s USING live WHERE s.worker_id = live.worker_id AND s.kind = live.kind
"""


def _take_idle_seats(claim: ClusterClaim) -> bool:
    workers = [w for w, _ in claim.idle_seats]
    kinds = [k for _, k in claim.idle_seats]
    with connection.cursor() as cursor:
        cursor.execute(TAKE_IDLE_SEATS_SQL, [workers, kinds, claim.idle_since])
        return cursor.rowcount == len(claim.idle_seats)


def _close_sql(moves_cluster: bool) -> str:
    """The spec's Close, one statement of three guarded writes: the attempt closes with its
    outcome only from a state its machine allows (PrepareFailed only before the start), and
    only then are its open member rows abandoned and, when asked, its cluster moved, in the
    lock order above (the attempt, its rows, its cluster: the sub-statements of a WITH run in
    no set order, so the cluster's reads the count of the abandoned rows). Asked to move the
    cluster, the attempt closes only if its cluster may make that move."""
    movable = (
        " AND EXISTS (SELECT 1 FROM cluster_job c WHERE c.id = cluster_attempt.cluster_job_id"
        f" AND {CLUSTER_MACHINE.guard('c', 'cluster_from')})"
    )
    closed = ATTEMPT_MACHINE.update(
        "close",
        "id = %(attempt)s" + (movable if moves_cluster else ""),
        returning="id, cluster_job_id",
    )
    abandoned = DISPATCHED_MACHINE.update(
        "abandon", "cluster_attempt_id = (SELECT id FROM closed)", returning="1"
    )
    cluster = CLUSTER_MACHINE.update(
        "cluster",
        "id = (SELECT cluster_job_id FROM closed) AND (SELECT count(*) FROM abandoned) >= 0",
    )
    moved = f", cluster AS ({cluster})" if moves_cluster else ""
    return (
        f"WITH closed AS ({closed}), abandoned AS ({abandoned}){moved}\n"
        "SELECT cluster_job_id FROM closed"
    )


CLOSE_ATTEMPT_SQL = {moves: _close_sql(moves) for moves in (False, True)}


def close_cluster_attempt(
    attempt_id, outcome: str, now: datetime | None = None, *, cluster_status: str | None = None
) -> int | None:
    """Close an open attempt with its outcome, abandoning every open member row with it, and
    move its cluster to `cluster_status` if given.

    Runs in the caller's transaction (alone, it is one statement, so still all or nothing).
    Returns the cluster's id, or None (falsy) when the attempt could not close: a second
    close, such as a prepare timeout racing a member's failure, touches nothing.
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
        cursor.execute(CLOSE_ATTEMPT_SQL[cluster_status is not None], params)
        row = cursor.fetchone()
    return None if row is None else row[0]


def _member_jobs(attempt_id) -> tuple[list, list]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT evaluation_id, derivation_build_id FROM dispatched_job"
            " WHERE cluster_attempt_id = %s",
            [attempt_id],
        )
        rows = cursor.fetchall()
    return [e for e, _ in rows if e], [b for _, b in rows if b]


# What handing members back to the queue moves, by kind: builds still Building (their
# Assigned transition undone), evaluations still EvaluatingFlake (started with the attempt).
RELEASED_FROM = {
    JobKind.BUILD: frozenset({BuildStatus.BUILDING}),
    JobKind.EVAL: frozenset({EvaluationStatus.EVALUATING_FLAKE}),
}


def release_members(attempt_id) -> None:
    """Hand the attempt's member jobs back to the queue."""
    evaluations, builds = _member_jobs(attempt_id)
    advance_builds(builds, BuildStatus.QUEUED, RELEASED_FROM[JobKind.BUILD])
    advance_evaluations(evaluations, EvaluationStatus.QUEUED, RELEASED_FROM[JobKind.EVAL])


def fail_prepare_attempt(attempt_id) -> bool:
    """The spec's fail-prepare, one transaction: a reject, a prepare timeout or a held member's
    failure closes the unstarted attempt PrepareFailed (close_cluster_attempt) and hands its
    builds back. The spec also puts a Running cluster back to Queued; a cluster goes Running
    only when its attempt starts (ACCEPT_SQL in clusters.coordinator), so the cluster of an
    unstarted attempt is still Queued and nothing is written to it. Failed prepares are not
    counted (the counter moves at the start too), and the backoff runs from this attempt's
    finished_at. False if the attempt had started or was closed already: nothing changes."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        if close_cluster_attempt(attempt_id, AttemptOutcome.PREPARE_FAILED):
            release_members(attempt_id)
            return True
    return False
