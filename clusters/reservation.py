"""The spec's Aging Reservations: a cluster that found no simultaneously idle workers for
GRADIENT_CLUSTER_RESERVE_AFTER_SECS reserves a placement instead of waiting for idle workers
to line up by chance.

The reservation is a row (one active at a time, by a partial unique index), so every process
sees it and a restart keeps it. Reserved workers keep their running jobs but get no new single
job of the reserved kind; once every seat is idle, the reservation commits like an ordinary
placement. It is released after GRADIENT_CLUSTER_RESERVE_TIMEOUT_SECS, when a seat's worker
disconnects or is quarantined, or when the cluster leaves the queue; the next pass can then
reserve again. The aging clock, cluster_job.waiting_since, is kept here too (note_waiting).
"""

import logging
from collections.abc import Mapping
from datetime import timedelta

import numpy as np
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from clusters import planner, statements
from clusters.book import StartableCluster, planned_cluster
from clusters.fleet import fleet, planned_worker
from clusters.models import (
    ClusterJob,
    ClusterReservation,
    ClusterStatus,
    ReservationSeat,
    open_attempts,
)
from gradient.logs import ids
from gradient.postgresql.arrays import int_array
from workers.health import quarantined_q
from workers.models import IdleSlot, JobScore, Worker, idle_slot_fresh_since

log = logging.getLogger(__name__)


def note_waiting(waiting: list[int], now) -> None:
    """Start the clocks of these clusters (able to start, unplaced) where not running, and
    stop every other one: one statement, whatever the number of clusters."""
    with connection.cursor() as cursor:
        cursor.execute(statements.NOTE_WAITING_SQL, {"waiting": int_array(waiting), "now": now})


def active_reservation() -> ClusterReservation | None:
    return ClusterReservation.objects.filter(released_at__isnull=True).first()


def reserved_workers() -> dict[int, int]:
    """worker id -> the cluster its seat is reserved for (the active reservation's seats)."""
    return dict(
        ReservationSeat.objects.filter(reservation__released_at__isnull=True).values_list(
            "worker_id", "reservation__cluster_job_id"
        )
    )


def release(reservation_id, reason: str) -> bool:
    released = ClusterReservation.objects.filter(
        pk=reservation_id, released_at__isnull=True
    ).update(released_at=timezone.now(), release_reason=reason)
    if released:
        log.info("reservation %s released: %s", reservation_id, reason)
    return bool(released)


def release_stale(now) -> str | None:
    """Release the active reservation when it timed out, a seat's worker disconnected, its
    cluster left the queue (finished, aborted, or claimed: an open attempt), or its members
    are no longer the seats' jobs (it could never commit), or a seat's worker was quarantined;
    the reason."""
    active = active_reservation()
    if active is None:
        return None
    timeout = timedelta(seconds=settings.GRADIENT["CLUSTER_RESERVE_TIMEOUT_SECS"])
    cluster = active.cluster_job
    if active.created_at < now - timeout:
        reason = "timed out"
    elif Worker.objects.filter(
        Q(channel_name__isnull=True) | Q(revoked_at__isnull=False),
        pk__in=active.seats.values("worker_id"),
    ).exists():
        reason = "a seat's worker disconnected"
    elif Worker.objects.filter(
        quarantined_q(now), pk__in=active.seats.values("worker_id")
    ).exists():
        reason = "a seat's worker was quarantined"
    elif cluster.status != ClusterStatus.QUEUED or open_attempts(cluster.pk).exists():
        reason = "the cluster left the queue"
    elif {m.job_key for m in cluster.members.all()} != set(
        active.seats.values_list("job_id", flat=True)
    ):
        reason = "the cluster's members changed"
    else:
        return None
    if not release(active.pk, reason):
        return None
    if reason == "timed out":
        # Its aging clock starts again, so the seats are not held again at once: other
        # overdue clusters may reserve first, and single jobs run meanwhile.
        ClusterJob.objects.filter(pk=cluster.pk, waiting_since__isnull=False).update(
            waiting_since=now
        )
    return reason


def first_target(clusters: list[StartableCluster], now) -> planner.Placement | None:
    """The target of the first of these clusters that has one: the planner's match over every
    connected eligible worker, idle workers seated first (a busy worker costs as the dearest
    seat, an idle one at most its known size). One read of the fleet and one walk of the
    planner for them all, a cluster's scores read only once the planner needs them: a pass
    with many overdue clusters that no fleet could seat costs one target, not one each."""
    if not clusters:
        return None
    rows, access = fleet(now, idle_only=False)
    workers = tuple(
        # Busy or not, every kind it can take counts as a seat: a reservation waits for it.
        planned_worker(
            w,
            (kind for kind, can in (("eval", w.can_eval), ("build", w.can_build)) if can),
            access.get(w.pk, frozenset()),
            quarantined=w.quarantined,
        )
        for w in rows
    )
    snapshot = planner.Snapshot(
        clusters=tuple(planned_cluster(c) for c in clusters),
        workers=workers,
        score_arrays=_TargetScores(clusters, rows),
    )
    return next(planner.placements(snapshot), None)


class _TargetScores(Mapping):
    """The planner's scores for targets (job key -> arrays), a cluster's read when the planner
    first asks for one of its members: an idle seat of the member's kind costs its known size,
    or the cluster's dearest known size where it has none; a busy seat has no score, the
    dearest of all."""

    def __init__(self, clusters: list[StartableCluster], rows):
        self._cluster_of = {m.key: c for c in clusters for m in c.members}
        self._idle = {
            kind: np.array([w.pk for w in rows if kind in w.kinds], dtype=np.int64)
            for kind in planner.KINDS
        }
        self._arrays: dict[str, planner.ScoreArrays] = {}

    def __getitem__(self, key: str) -> planner.ScoreArrays:
        if key not in self._arrays:
            self._arrays.update(self._read(self._cluster_of[key]))
        return self._arrays[key]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def _read(self, cluster: StartableCluster) -> dict[str, planner.ScoreArrays]:
        keys = [m.key for m in cluster.members]
        known: dict[str, dict[int, int]] = {key: {} for key in keys}
        for worker_id, job_id, size in JobScore.objects.filter(
            job_id__in=keys, missing_nar_size__isnull=False
        ).values_list("worker_id", "job_id", "missing_nar_size"):
            known[job_id][worker_id] = size
        top = max((s for sizes in known.values() for s in sizes.values()), default=0)
        arrays = {}
        for member in cluster.members:
            ids = self._idle.get(member.kind, np.zeros(0, dtype=np.int64))
            sizes = np.full(ids.size, top, dtype=np.int64)
            of_member = known[member.key]
            if of_member:
                scored = np.fromiter(of_member, np.int64, len(of_member))
                at = np.searchsorted(ids, scored)
                hit = at < ids.size
                hit[hit] = ids[at[hit]] == scored[hit]
                sizes[at[hit]] = np.fromiter(of_member.values(), np.int64, len(of_member))[hit]
            order = np.lexsort((ids, sizes))  # by size, then worker id
            arrays[member.key] = (ids[order], sizes[order])
        return arrays


def reserve(placement: planner.Placement) -> ClusterReservation | None:
    """Hold the placement's seats; None when another cluster holds the reservation."""
    try:
        with transaction.atomic(durable=True):
            reservation = ClusterReservation.objects.create(
                cluster_job_id=placement.cluster_id, created_at=timezone.now()
            )
            ReservationSeat.objects.bulk_create(
                ReservationSeat(
                    reservation=reservation,
                    worker_id=seat.worker.id,
                    kind=seat.member.kind,
                    job_id=seat.member.key,
                )
                for seat in placement.seats
            )
    except IntegrityError:
        return None  # one at a time: another pass reserved first
    # Stamped again once committed: a claim's statement that began before the commit did not
    # see the seats held, and its dispatched_at is earlier than this.
    reservation.created_at = timezone.now()
    ClusterReservation.objects.filter(pk=reservation.pk).update(created_at=reservation.created_at)
    log.info(
        "cluster %s reserved %s",
        placement.cluster_id,
        [s.worker.name for s in placement.seats],
        extra=ids(cluster=placement.cluster_id, worker=[s.worker.id for s in placement.seats]),
    )
    return reservation


def committable(reservation: ClusterReservation, book: dict[int, StartableCluster], now):
    """The reservation as an ordinary placement, once every seat holds a live idle slot of its
    kind and the cluster can start; else None."""
    cluster = book.get(reservation.cluster_job_id)
    if cluster is None:
        return None
    seats = list(reservation.seats.select_related("worker"))
    idle = set(
        IdleSlot.objects.filter(
            worker_id__in=[s.worker_id for s in seats], recorded_at__gte=idle_slot_fresh_since(now)
        ).values_list("worker_id", "kind")
    )
    if any((s.worker_id, s.kind) not in idle for s in seats):
        return None
    by_key = {m.key: m for m in cluster.members}
    if set(by_key) != {s.job_id for s in seats}:
        return None  # the members changed since it was reserved: release_stale releases it
    return planner.Placement(
        cluster_id=cluster.id,
        zone=None,
        seats=tuple(
            planner.Seat(by_key[s.job_id].planned(), planned_worker(s.worker, (), None), None)
            for s in seats
        ),
        cost=0,
    )


def due(book: list[StartableCluster], placed: set[int], now) -> list[StartableCluster]:
    """Clusters in the book, not placed this pass, waiting longer than reserve-after."""
    after = timedelta(seconds=settings.GRADIENT["CLUSTER_RESERVE_AFTER_SECS"])
    return [
        c
        for c in book
        if c.id not in placed and c.waiting_since is not None and c.waiting_since < now - after
    ]
