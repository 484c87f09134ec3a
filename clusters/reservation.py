"""The spec's Aging Reservations: a cluster that found no simultaneously idle workers for
GRADIENT_CLUSTER_RESERVE_AFTER_SECS reserves a placement instead of waiting for idle workers
to line up by chance.

The reservation is a row (one active at a time, by a partial unique index), so every process
sees it and a restart keeps it. Reserved workers keep their running jobs but get no new single
job of the reserved kind; once every seat is idle, the reservation commits like an ordinary
placement. It is released after GRADIENT_CLUSTER_RESERVE_TIMEOUT_SECS, when a seat's worker
disconnects or is quarantined, or when the cluster leaves the queue; the next pass can then
reserve again.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from clusters import planner
from clusters.models import ClusterJob, ClusterReservation, ClusterStatus, ReservationSeat
from clusters.tracking import StartableCluster, planned_cluster, planned_worker
from gradient.logs import ids
from workers.health import is_quarantined, quarantined_q
from workers.models import IdleSlot, JobScore, Worker

log = logging.getLogger(__name__)


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
    elif (
        cluster.status != ClusterStatus.QUEUED
        or cluster.attempts_made.filter(finished_at__isnull=True).exists()
    ):
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


def target(cluster: StartableCluster, now) -> planner.Placement | None:
    """The planner's match over every connected eligible worker, idle workers seated first:
    a busy worker counts as the dearest seat, an idle one costs at most its known size."""
    workers = list(
        Worker.objects.filter(
            channel_name__isnull=False, revoked_at__isnull=True, draining=False
        ).prefetch_related("projects")
    )
    ttl = timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
    idle = set(IdleSlot.objects.filter(recorded_at__gte=now - ttl).values_list("worker_id", "kind"))
    keys = [m.key for m in cluster.members]
    known: dict[str, dict[int, int]] = {}
    for worker_id, job_id, size in JobScore.objects.filter(
        job_id__in=keys, missing_nar_size__isnull=False
    ).values_list("worker_id", "job_id", "missing_nar_size"):
        known.setdefault(job_id, {})[worker_id] = size
    top = max((s for sizes in known.values() for s in sizes.values()), default=0)
    scores: dict[str, dict[int, int]] = {}
    for member in cluster.members:
        for w in workers:
            if (w.pk, member.kind) in idle:
                scores.setdefault(member.key, {})[w.pk] = known.get(member.key, {}).get(w.pk, top)
    snapshot = planner.Snapshot(
        clusters=(planned_cluster(cluster),),
        # Busy or not, every kind it can take counts as a seat: a reservation waits for it.
        workers=tuple(
            planned_worker(
                w,
                (k for k, can in (("eval", w.can_eval), ("build", w.can_build)) if can),
                frozenset(p.pk for p in w.projects.all()),
                quarantined=is_quarantined(w, now),
            )
            for w in workers
        ),
        score_arrays=planner.score_arrays(scores),
    )
    placements = planner.plan(snapshot)
    return placements[0] if placements else None


def reserve(placement: planner.Placement) -> ClusterReservation | None:
    """Hold the placement's seats; None when another cluster holds the reservation."""
    try:
        with transaction.atomic(durable=True):
            # Stamped now, not at the pass's start: from here on its seats get no single job.
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
    ttl = timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
    seats = list(reservation.seats.select_related("worker"))
    idle = set(
        IdleSlot.objects.filter(
            worker_id__in=[s.worker_id for s in seats], recorded_at__gte=now - ttl
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
