"""The cluster-dispatch pass: expire overdue prepares, then place every cluster that can start
(prioritized first, then the oldest), take each placement's seats and claim it (in batches,
each claim winning or losing on its own), and send every seat its AssignJob with the hold.

It runs every GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS and whenever a RequestJob goes
unanswered while a cluster waits for seats. Any number may be started at once: one at a time
does the work (an advisory lock), and each claim re-checks what it takes, so a second pass
could only lose its claims.
"""

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import batched
from typing import NamedTuple

import numpy as np
import redis
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from clusters import planner, reservation
from clusters.claim import ClusterClaim, claim_cluster, claim_clusters
from clusters.models import AttemptOutcome
from clusters.recovery import expire_overdue_prepares
from clusters.tracking import (
    MemberRow,
    StartableCluster,
    planned_cluster,
    planned_worker,
    startable_clusters,
)
from gradient import metrics
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import JobKind
from gradient.logs import ids
from workers.groups import send_frames
from workers.protocol import AssignJob, ClusterHold, JobSpec

log = logging.getLogger(__name__)

PASS_LOCK = 0x6772_6164_6973  # advisory lock key of the dispatch pass
MEMBER_STEPS = {
    JobKind.EVAL: ["fetch", "evaluate_flake", "evaluate_derivations"],  # never split
    JobKind.BUILD: ["build"],
}


@dataclass
class PassResult:
    expired: int = 0
    ready: int = 0
    placed: int = 0
    claimed: list = field(default_factory=list)
    seconds: float = 0.0
    skipped: bool = False
    reservation: str | None = None


# The connected workers with a live idle slot, with what the planner asks of them.
IDLE_WORKERS_SQL = """
SELECT w.id, w.name, w.zone, w.architectures, w.system_features, w.all_projects,
       w.can_eval, w.can_build, array_agg(s.kind)
FROM idle_slot s
JOIN worker w ON w.id = s.worker_id
WHERE s.recorded_at >= %(fresh)s
  AND w.channel_name IS NOT NULL AND NOT w.draining AND w.revoked_at IS NULL
  AND w.id <> ALL(%(reserved)s::bigint[])
GROUP BY w.id
ORDER BY w.id
"""

# Each member job's cheapest answered scores (at most %(limit)s; one more tells that there are
# more) in the order of idx-job_score-job-size, (size, worker id), packed as big-endian int64
# pairs: an index-only scan of a few hundred entries per job instead of every score. The
# planner reads the rest of a job only when too few of its cheapest are left to decide
# (load_scores). Scores of workers without an idle slot come along and are dropped by the
# planner: filtering on the idle ones here costs more than it saves, though in a fleet where
# most workers are busy it makes the planner read more jobs in full.
CHEAPEST_SCORES_SQL = """
SELECT k.key, top.packed, top.n
FROM unnest(%(keys)s::text[]) AS k(key)
CROSS JOIN LATERAL (
    SELECT string_agg(int8send(c.worker_id) || int8send(c.missing_nar_size), ''::bytea)
               AS packed,
           count(*) AS n
    FROM (SELECT s.worker_id, s.missing_nar_size FROM job_score s
          WHERE s.job_id = k.key AND s.missing_nar_size IS NOT NULL
          ORDER BY s.missing_nar_size, s.worker_id
          LIMIT %(limit)s + 1) c
) top
WHERE top.n > 0
"""

# Every answered score of some jobs (the planner drops those of workers it does not know),
# each job's from the index alone. No filter on the idle workers: binding thousands of ids
# costs more per query than the few extra rows do.
ALL_SCORES_SQL = """
SELECT k.key, top.packed
FROM unnest(%(keys)s::text[]) AS k(key)
CROSS JOIN LATERAL (
    SELECT string_agg(int8send(s.worker_id) || int8send(s.missing_nar_size), ''::bytea) AS packed
    FROM job_score s WHERE s.job_id = k.key AND s.missing_nar_size IS NOT NULL
) top
WHERE top.packed IS NOT NULL
"""

# The workers that did not accept in any of each cluster's failed prepares since its last
# attempt that started (planner.Cluster.avoid). Not the last prepare's alone: with two workers
# that never answer, the cluster went back and forth between them, one timeout after another.
UNRESPONSIVE_SQL = """
SELECT a.cluster_job_id, array_agg(DISTINCT d.worker_id)
FROM cluster_attempt a
JOIN dispatched_job d ON d.cluster_attempt_id = a.id AND d.accepted_at IS NULL
WHERE a.cluster_job_id = ANY(%(clusters)s) AND a.outcome = %(prepare_failed)s
  AND a.created_at > COALESCE((SELECT max(s.created_at) FROM cluster_attempt s
                               WHERE s.cluster_job_id = a.cluster_job_id
                                 AND s.started_at IS NOT NULL), '-infinity')
GROUP BY a.cluster_job_id
"""

# How many of each job's cheapest scores a pass reads up front. A member needs k free seats
# of its own per zone among them; fewer, and the planner reads that job in full.
CHEAPEST = 128


def _unpack(packed: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(worker ids, sizes) sorted by (size, worker id), as the planner needs them to tell that
    a job's cheapest are a prefix of its full list."""
    pairs = np.frombuffer(packed, dtype=">i8").reshape(-1, 2)
    ids, sizes = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    ordered = (np.diff(sizes) > 0) | ((np.diff(sizes) == 0) & (np.diff(ids) > 0))
    if not ordered.all():
        order = np.lexsort((ids, sizes))
        ids, sizes = ids[order], sizes[order]
    return ids, sizes


def all_scores(keys: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every answered score of these jobs, sorted like their cheapest: by (size, worker id)."""
    with connection.cursor() as cursor:
        cursor.execute(ALL_SCORES_SQL, {"keys": keys})
        rows = cursor.fetchall()
    return {job_id: _unpack(packed) for job_id, packed in rows}


class _IdleWorker(NamedTuple):
    """A row of IDLE_WORKERS_SQL, with the names planned_worker reads."""

    pk: int
    name: str
    zone: str | None
    architectures: list[str]
    system_features: list[str]
    all_projects: bool
    can_eval: bool
    can_build: bool
    kinds: list[str]


@contextmanager
def _own_connection():
    """Work on a pass's thread, with that thread's own connection: dropped before if it broke
    or aged out, and after if it aged out meanwhile (CONN_MAX_AGE), as Django does around a
    request."""
    close_old_connections()
    try:
        yield
    finally:
        close_old_connections()


# Keys per read of CHEAPEST_SCORES_SQL: the first clusters' scores arrive after one small read.
SCORE_CHUNK = 256
# The cheapest scores are read on a thread of their own, with its own database connection,
# while the planner seats the clusters whose scores have arrived: reading them is PostgreSQL's
# work, planning is Python's, and on a machine of two cores the one need not wait for the other.
_score_reader = ThreadPoolExecutor(1, thread_name_prefix="scores")


class CheapestScores(Mapping):
    """Each member job's cheapest scores, job key -> (worker ids, sizes), read in chunks of
    keys in the order given (the clusters' priority order). A lookup waits for its key's chunk;
    `truncated` tells (waiting likewise) whether a key has more scores than were read."""

    def __init__(self, keys: list[str]):
        self._keys = keys
        self._chunk_of = {key: i // SCORE_CHUNK for i, key in enumerate(keys)}
        self._read = [threading.Event() for _ in range(0, len(keys), SCORE_CHUNK)]
        self._whole = [False] * len(self._read)  # chunks read to the end
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._truncated: set[str] = set()
        self._error: BaseException | None = None
        self._stop = False
        self._future = None
        self.truncated = _Truncated(self)

    def read(self) -> None:
        """Read every chunk in order (on the calling thread)."""
        try:
            with connection.cursor() as cursor:
                for chunk, ready in enumerate(self._read):
                    if self._stop:
                        raise RuntimeError("the pass stopped reading scores")
                    keys = self._keys[chunk * SCORE_CHUNK : (chunk + 1) * SCORE_CHUNK]
                    cursor.execute(CHEAPEST_SCORES_SQL, {"keys": keys, "limit": CHEAPEST})
                    for job_id, packed, count in cursor.fetchall():
                        ids, sizes = _unpack(packed)
                        if count > CHEAPEST:
                            ids, sizes = ids[:CHEAPEST], sizes[:CHEAPEST]
                            self._truncated.add(job_id)
                        self._arrays[job_id] = (ids, sizes)
                    self._whole[chunk] = True
                    ready.set()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            for ready in self._read:
                ready.set()  # a reader that failed leaves nobody waiting: they see the error

    def start(self) -> "CheapestScores":
        """Read on the scores' thread (and its connection) from now on."""

        def on_thread():
            with _own_connection():
                self.read()

        self._future = _score_reader.submit(on_thread)
        return self

    def finish(self) -> None:
        """Stop reading (if still at it) and wait for the reader: a pass ends with its reads."""
        self._stop = True
        if self._future is not None:
            wait([self._future])

    def wait_for(self, key: str) -> None:
        chunk = self._chunk_of.get(key)
        if chunk is not None:
            self._read[chunk].wait()
            if not self._whole[chunk]:
                raise RuntimeError("reading the cheapest scores failed") from self._error

    def __getitem__(self, key: str):
        self.wait_for(key)
        return self._arrays[key]

    def __iter__(self):
        for key in self._keys:
            self.wait_for(key)
        return iter(self._arrays)

    def __len__(self) -> int:
        for key in self._keys:
            self.wait_for(key)
        return len(self._arrays)


class _Truncated:
    def __init__(self, scores: CheapestScores):
        self._scores = scores

    def __contains__(self, key) -> bool:
        self._scores.wait_for(key)
        return key in self._scores._truncated


def snapshot(
    clusters: list[StartableCluster], now, reserved=(), *, stream: bool = False
) -> planner.Snapshot:
    """What the planner needs, read in a few queries of plain rows: the connected workers
    with a live idle slot (but for the `reserved` ones), and each member job's cheapest
    scores, with a loader for the rest (all_scores). With `stream`, the scores are still being
    read on their own thread when this returns (CheapestScores.finish waits for the reader)."""
    ttl = timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
    keys = [m.key for c in clusters for m in c.members]
    access: dict[int, set[int]] = {}
    with connection.cursor() as cursor:
        cursor.execute(IDLE_WORKERS_SQL, {"fresh": now - ttl, "reserved": list(reserved)})
        idle = [_IdleWorker._make(row) for row in cursor.fetchall()]
        limited = [w.pk for w in idle if not w.all_projects]
        if limited:
            cursor.execute(
                "SELECT worker_id, project_id FROM worker_projects WHERE worker_id = ANY(%s)",
                [limited],
            )
            for worker_id, project_id in cursor.fetchall():
                access.setdefault(worker_id, set()).add(project_id)
        avoid: dict[int, frozenset[int]] = {}
        if idle and clusters:
            cursor.execute(
                UNRESPONSIVE_SQL,
                {
                    "clusters": [c.id for c in clusters],
                    "prepare_failed": AttemptOutcome.PREPARE_FAILED.value,
                },
            )
            avoid = {cluster_id: frozenset(workers) for cluster_id, workers in cursor.fetchall()}
    scores = CheapestScores(keys if idle else [])
    if stream and not connection.in_atomic_block:
        scores.start()
    else:
        # Inside a transaction of the caller's (tests), whose rows no other connection sees.
        scores.read()
    return planner.Snapshot(
        clusters=tuple(planned_cluster(c, avoid.get(c.id, frozenset())) for c in clusters),
        workers=tuple(planned_worker(w, w.kinds, frozenset(access.get(w.pk, ()))) for w in idle),
        scores={},
        score_arrays=scores,
        truncated=scores.truncated,
        load_scores=all_scores,
    )


def hold_secs() -> int:
    # A worker never hearing StartCluster releases the slot on its own, a little after the
    # server has given up on the prepare.
    return int(settings.GRADIENT["CLUSTER_PREPARE_TIMEOUT_SECS"]) + 10


def _cluster_claim(placement: planner.Placement, rows: dict[str, MemberRow], since):
    """The claim of a placement: its members' assignments and its seats' idle slots."""
    members = [(seat, rows[seat.member.key]) for seat in placement.seats]
    claim = ClusterClaim(
        cluster_id=placement.cluster_id,
        members=[
            Assignment(
                gate=ClaimGate(row.kind, row.job, row.substitute),
                worker_id=seat.worker.id,
                project_id=row.project_id,
                steps=MEMBER_STEPS[row.kind],
                missing_nar_size=seat.missing_nar_size,
            )
            for seat, row in members
        ],
        idle_seats=[(seat.worker.id, row.kind) for seat, row in members],
        idle_since=since,
    )
    return claim, members


def _frames(placement: planner.Placement, claim: ClusterClaim, members: list) -> list:
    """The AssignJob frames of a claim won."""
    frames = []
    hold = hold_secs()
    for assignment, (seat, row) in zip(claim.members, members, strict=True):
        frames.append(
            (
                seat.worker.id,
                AssignJob(
                    job_id=row.key,
                    assignment_id=str(assignment.id),
                    job=JobSpec(
                        kind=row.kind,
                        project=row.project,
                        evaluation=str(row.job) if row.kind == JobKind.EVAL else None,
                        build=str(row.job) if row.kind == JobKind.BUILD else None,
                        architecture=row.architecture,
                        required_features=list(row.features),
                        steps=assignment.steps,
                    ),
                    cluster=ClusterHold(
                        attempt=str(claim.attempt_id),
                        role=row.role,
                        index=row.index,
                        hold_secs=hold,
                    ),
                ),
            )
        )
    log.info(
        "cluster %s claimed as attempt %s",
        placement.cluster_id,
        claim.attempt_id,
        extra=ids(
            cluster=placement.cluster_id,
            attempt=claim.attempt_id,
            worker=[seat.worker.id for seat, _ in members],
        ),
    )
    return frames


def claim_placement(placement: planner.Placement, rows: dict[str, MemberRow], since) -> list:
    """Take the seats and claim the cluster in one transaction; the AssignJob frames to send
    (empty when the claim was lost: nothing written, the members wait for the next pass)."""
    claim, members = _cluster_claim(placement, rows, since)
    if not claim_cluster(claim):
        return []
    return _frames(placement, claim, members)


def _claim_and_send(placement: planner.Placement, rows: dict, since) -> bool:
    frames = claim_placement(placement, rows, since)
    if frames:
        send_frames(frames)
    return bool(frames)


# Placements claimed together: one transaction and two round trips per batch (claim_clusters),
# each claim still winning or losing on its own. The AssignJobs of a batch go out as soon as it
# commits, so the first seats hear of their claim after one batch, not after the pass.
CLAIM_BATCH = 128

# The batches are claimed on a thread of their own, with its own database connection, while
# the planner seats the next clusters: a batch mostly waits for PostgreSQL, the planner is
# Python, and on a machine of two cores one's wait is the other's time (docs/benchmarks.md).
# One thread, so the batches claim in the planner's order: prioritized clusters first.
_claimer = ThreadPoolExecutor(1, thread_name_prefix="claims")


def _claim_batch(placements: tuple[planner.Placement, ...], rows: dict, since) -> set[int]:
    """Claim the placements and send the AssignJobs of those won; the clusters claimed."""
    batch = [(placement, *_cluster_claim(placement, rows, since)) for placement in placements]
    won = claim_clusters([claim for _, claim, _ in batch])
    frames, claimed = [], set()
    for (placement, claim, members), ok in zip(batch, won, strict=True):
        if ok:
            frames += _frames(placement, claim, members)
            claimed.add(placement.cluster_id)
    if frames:
        send_frames(frames)
    return claimed


def _claim_on_thread(placements, rows: dict, since) -> set[int]:
    with _own_connection():
        return _claim_batch(placements, rows, since)


def _claim_all(placements: Iterable[planner.Placement], rows: dict, since):
    """Claim the placements in batches as the planner yields them; every placement, and the
    clusters claimed. Inside a transaction of the caller's (tests), whose rows no other
    connection sees, the batches are claimed on the caller's connection instead."""
    inline = connection.in_atomic_block
    placed: list[planner.Placement] = []
    claimed: set[int] = set()
    pending = []
    try:
        for batch in batched(placements, CLAIM_BATCH):
            placed += batch
            if inline:
                claimed |= _claim_batch(batch, rows, since)
            else:
                pending.append(_claimer.submit(_claim_on_thread, batch, rows, since))
    finally:
        # Even when planning failed: the pass ends (and lets the next one in) after its claims.
        wait(pending)
    for future in pending:
        claimed |= future.result()
    return placed, claimed


def age_reservations(ready, claimed: set[int], rows: dict, since, now) -> str | None:
    """Release a stale reservation, commit the active one once its seats are idle, or let the
    oldest overdue cluster reserve. What happened, for the pass's result."""
    released = reservation.release_stale(now)
    active = reservation.active_reservation()
    if active is not None:
        placement = reservation.committable(active, {c.id: c for c in ready}, now)
        if placement is not None and _claim_and_send(placement, rows, since):
            claimed.add(active.cluster_job_id)
            reservation.release(active.pk, "committed")
            return "committed"
        return f"released: {released}" if released else "holding"
    for cluster in reservation.due(ready, claimed, now):
        target = reservation.target(cluster, now)
        if target is not None and reservation.reserve(target, now) is not None:
            return "reserved"
    return f"released: {released}" if released else None


def _try_lock(wait: bool) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [PASS_LOCK])
        if cursor.fetchone()[0]:
            return True  # (one round trip when no other pass runs)
        if wait:
            # A woken pass waits for the running one: the wake-up may carry its new idle slot.
            cursor.execute("SET lock_timeout = '10s'")
            try:
                cursor.execute("SELECT pg_advisory_lock(%s)", [PASS_LOCK])
                return True
            except Exception:
                return False
            finally:
                cursor.execute("RESET lock_timeout")
        return False


def run_pass(wait: bool = False) -> PassResult:
    began = time.monotonic()
    result = PassResult()
    if not _try_lock(wait):
        result.skipped = True
        return result
    try:
        result.expired = len(expire_overdue_prepares())
        now = timezone.now()
        since = now - timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
        ready = startable_clusters(now)
        result.ready = len(ready)
        rows = {m.key: m for c in ready for m in c.members}
        if ready:
            # Other clusters plan over the unreserved idle workers.
            seen = snapshot(ready, now, reservation.reserved_workers(), stream=True)
            try:
                placed, claimed = _claim_all(planner.placements(seen), rows, since)
            finally:
                seen.score_arrays.finish()
            result.placed = len(placed)
            result.claimed = [p.cluster_id for p in placed if p.cluster_id in claimed]
        result.reservation = age_reservations(ready, set(result.claimed), rows, since, now)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [PASS_LOCK])
        result.seconds = time.monotonic() - began
        metrics.observe_dispatch_pass(result.seconds)
    return result


# Wake-ups: coalesced in Redis so a burst of unanswered RequestJobs queues one pass.

WAKE_KEY = "gradient:dispatch:queued"
_redis = None


def _client():
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1)
    return _redis


# A wake-up can place something only while a cluster waits for seats (Queued, no open attempt)
# or a reservation waits for its seats to be idle. Otherwise idle workers asking for work would
# keep a pass running back to back, and the one wake-up that completes a placement would
# queue behind it.
WAITING_SQL = """
SELECT EXISTS (SELECT 1 FROM cluster_job c WHERE c.status = 'Queued'
               AND NOT EXISTS (SELECT 1 FROM cluster_attempt a
                               WHERE a.cluster_job_id = c.id AND a.finished_at IS NULL))
    OR EXISTS (SELECT 1 FROM cluster_reservation r WHERE r.released_at IS NULL)
"""


def clusters_waiting() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute(WAITING_SQL)
            return cursor.fetchone()[0]
    except DatabaseError:
        return True  # not known: wake, as before


def wake_dispatch() -> bool:
    """Queue a dispatch pass unless one is queued and not yet started, or no cluster waits
    for seats. Best effort: losing Redis loses only wake-ups, which the periodic pass makes
    up for."""
    from clusters.tasks import dispatch

    if not clusters_waiting():
        return False
    try:
        if not _client().set(WAKE_KEY, 1, nx=True, ex=10):
            return False
        dispatch.delay(woken=True)
    except Exception:
        log.warning("could not wake the dispatch pass", exc_info=True)
        return False
    return True


def clear_wake() -> None:
    """Called as a woken pass starts: a wake-up from now on queues another pass."""
    try:
        _client().delete(WAKE_KEY)
    except Exception:
        log.warning("could not clear the dispatch wake-up", exc_info=True)
