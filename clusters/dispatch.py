"""The cluster-dispatch pass: expire overdue prepares, then place every cluster that can start
(prioritized first, then the oldest), take each placement's seats and claim it (in batches,
each claim winning or losing on its own), and send every seat its AssignJob with the hold.

It runs every GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS and whenever a RequestJob goes
unanswered while a cluster waits for seats. Any number may be started at once: one at a time
does the work (an advisory lock), and each claim re-checks what it takes, so a second pass
could only lose its claims.
"""

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import batched

from django.conf import settings
from django.db import connection
from django.utils import timezone

from clusters import planner, reservation, statements, wake
from clusters.asking import Asking
from clusters.book import MemberRow, StartableCluster, planned_cluster, startable_clusters
from clusters.claim import ClusterClaim, claim_clusters
from clusters.coordinator import expire_overdue_prepares
from clusters.fleet import fleet, planned_worker
from clusters.models import AttemptOutcome
from clusters.reservation import note_waiting
from clusters.scores import CheapestScores, all_scores, own_connection
from gradient import metrics
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.steps import MEMBER_STEPS
from gradient.logs import ids
from gradient.wire.groups import send_frames
from workers.assignment import assign_job
from workers.models import idle_slot_fresh_since

log = logging.getLogger(__name__)

PASS_LOCK = 0x6772_6164_6973  # advisory lock key of the dispatch pass


@dataclass
class PassResult:
    expired: int = 0
    ready: int = 0
    placed: int = 0
    claimed: list = field(default_factory=list)
    waiting_for_scores: bool = False
    held: int = 0  # clusters held back for their seats' scores, or for room in the head
    seconds: float = 0.0
    skipped: bool = False
    reservation: str | None = None


def snapshot(
    clusters: list[StartableCluster], now, reserved=(), *, stream: bool = False
) -> planner.Snapshot:
    """What the planner needs, read in a few queries of plain rows: the connected workers
    with a live idle slot (but for the `reserved` ones), and each member job's cheapest
    scores, with a loader for the rest (all_scores). With `stream`, the scores are
    still being read on their own thread when this returns (CheapestScores.finish waits);
    without, they are read before it returns, for a caller that plans once and stops."""
    keys = [m.key for c in clusters for m in c.members]
    idle, access = fleet(now, idle_only=True, reserved=reserved)
    avoid: dict[int, frozenset[int]] = {}
    if idle and clusters:
        with connection.cursor() as cursor:
            cursor.execute(
                statements.UNRESPONSIVE_SQL,
                {
                    "clusters": [c.id for c in clusters],
                    "prepare_failed": AttemptOutcome.PREPARE_FAILED.value,
                },
            )
            avoid = {cluster_id: frozenset(workers) for cluster_id, workers in cursor.fetchall()}
    idle_id = {w.name: w.pk for w in idle}
    pins = {m.key: idle_id.get(m.pin) for c in clusters for m in c.members if m.pin is not None}
    scores = CheapestScores(keys if idle else [], pins=pins)
    if stream:
        scores.start()
    else:
        scores.read()
    return planner.Snapshot(
        clusters=tuple(planned_cluster(c, avoid.get(c.id, frozenset())) for c in clusters),
        workers=tuple(
            planned_worker(w, w.kinds, access.get(w.pk, frozenset()), quarantined=w.quarantined)
            for w in idle
        ),
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
    attempt = str(claim.attempt_id)
    for assignment, (seat, row) in zip(claim.members, members, strict=True):
        hold_of = {"attempt": attempt, "role": row.role, "index": row.index, "hold_secs": hold}
        frames.append(
            (
                seat.worker.id,
                assign_job(
                    row.key,
                    assignment.id,
                    row.kind,
                    row.job,
                    row.project,
                    row.architecture,
                    row.features,
                    assignment.steps,
                    hold_of,
                    assignment.work,
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


# Placements claimed together: one transaction and two round trips per batch (claim_clusters),
# each claim still winning or losing on its own. The AssignJobs of a batch go out as soon as it
# commits, so the first seats hear of their claim after one batch, not after the pass.
CLAIM_BATCH = 128

# The batches are claimed on threads of their own, each with its own database connection,
# while the planner seats the next clusters: a batch mostly waits for PostgreSQL, the planner
# is Python, and on a machine of two cores one's wait is the other's time (docs/benchmarks.md).
# Three threads, so that batches' statements run while another's frames are built: a batch
# is mostly PostgreSQL (each claim checks its members' start before it writes, clusters.claim),
# and with fewer the claims outlast the plan and the pass waits for them. The batches of a
# pass are disjoint (a cluster, a job and a seat at most once), so they cannot deadlock or
# decide against each other; they start in the planner's order, prioritized clusters first.
_claimer = ThreadPoolExecutor(3, thread_name_prefix="claims")


def claim_placements(placements: tuple[planner.Placement, ...], rows: dict, since) -> set[int]:
    """Take the seats and claim each placement's cluster (one transaction for them all, each
    claim winning or losing on its own: a lost one writes nothing, its members wait for the
    next pass), then send the AssignJobs of those won; the clusters claimed."""
    batch = [(placement, *_cluster_claim(placement, rows, since)) for placement in placements]
    won = claim_clusters([claim for _, claim, _ in batch])
    frames, claimed = [], set()
    for (placement, claim, members), ok in zip(batch, won, strict=True):
        if ok:
            frames += _frames(placement, claim, members)
            claimed.add(placement.cluster_id)
    if frames:
        # Not waited for: the claims are committed, and a claimer thread waiting on its
        # sends would hold the next batch back.
        send_frames(frames, wait=False)
    return claimed


def _claim_on_thread(placements, rows: dict, since) -> set[int]:
    with own_connection():
        return claim_placements(placements, rows, since)


def _claim_all(placements: Iterable[planner.Placement], rows: dict, since):
    """Claim the placements in batches on the claimer threads as the planner yields them
    (three at a time); every placement, and the clusters claimed."""
    placed: list[planner.Placement] = []
    claimed: set[int] = set()
    pending = []
    try:
        for batch in batched(placements, CLAIM_BATCH):
            placed += batch
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
    if released:
        # The next pass may reserve again, not this one: reserving now would hold the same
        # seats straight away, and single jobs would never reach them.
        return f"released: {released}"
    active = reservation.active_reservation()
    if active is not None:
        placement = reservation.committable(active, {c.id: c for c in ready}, now)
        if placement is not None and claim_placements((placement,), rows, since):
            claimed.add(active.cluster_job_id)
            reservation.release(active.pk, "committed")
            return "committed"
        return "holding"
    target = reservation.first_target(reservation.due(ready, claimed, now), now)
    if target is not None and reservation.reserve(target) is not None:
        return "reserved"
    return None


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
        since = idle_slot_fresh_since(now)
        ready = startable_clusters(now)
        result.ready = len(ready)
        rows = {m.key: m for c in ready for m in c.members}
        if ready:
            # Other clusters plan over the unreserved idle workers.
            seen = snapshot(ready, now, reservation.reserved_workers(), stream=True)
            asking = Asking(ready, seen.workers, now)
            asking.ask_new()
            try:
                ready_to_claim = filter(asking.ready, planner.placements(seen, asking.admits))
                placed, claimed = _claim_all(ready_to_claim, rows, since)
            finally:
                seen.score_arrays.finish()
                asking.finish()
            result.placed = len(placed)
            result.claimed = [p.cluster_id for p in placed if p.cluster_id in claimed]
            result.held = asking.held
            if asking.due is not None:
                result.waiting_for_scores = True
                wake.run_at(asking.due)
        claimed_now = set(result.claimed)
        result.reservation = age_reservations(ready, claimed_now, rows, since, now)
        note_waiting([c.id for c in ready if c.id not in claimed_now], now)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [PASS_LOCK])
        result.seconds = time.monotonic() - began
        metrics.observe_dispatch_pass(result.seconds)
    return result
