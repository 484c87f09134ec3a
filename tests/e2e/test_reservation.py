"""Aging reservations end to end: a fleet kept busy by a stream of single jobs."""

import pytest

from clusters.models import ClusterAttempt, ClusterJob, ClusterReservation
from gradient.jobs.models import DispatchedJob
from gradient.jobs.submission import JobSpec, create_jobs
from tests.e2e.conftest import FAST
from tests.e2e.fleet import fleet, q, until
from tests.e2e.test_cluster_dispatch import submit
from tests.factories import ProjectFactory

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

RESERVE_AFTER = 3
JOB_SECS = (1.5, 2.5)
INTERVAL = float(FAST["GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS"])
# A frame's round trip through daphne, Celery and PostgreSQL on a loaded machine of 2 cores.
LATENCY = 0.5


async def test_a_cluster_never_seeing_enough_idle_workers_starts_through_a_reservation(
    processes,
):
    env = {"GRADIENT_CLUSTER_RESERVE_AFTER_SECS": RESERVE_AFTER}
    url = processes.daphne(**env)
    processes.celery(**env)

    def queue_singles(n):
        project = ProjectFactory(name="e2e")
        create_jobs(project, [JobSpec(kind="build") for _ in range(n)])

    await q(lambda: queue_singles(300))
    build_only = {"eval": False, "max_evals": 0, "job_secs": JOB_SECS}
    specs = {f"w{i}": build_only for i in range(6)}
    async with fleet(url, specs):
        # Every worker busy with singles, and beat running its passes, before the cluster
        # arrives: the clock starts at the first pass that sees it.
        await until(lambda: DispatchedJob.objects.filter(finished_at__isnull=True).count() == 6)
        await until(lambda: "clusters.dispatch[" in processes.log_text("celery-worker"))
        cluster = await submit("a:build", "b:build", "c:build", "d:build")
        # Its clock as the first pass that saw it wrote it (cleared once it is claimed).
        clock = await until(
            lambda: ClusterJob.objects.filter(pk=cluster).values_list("waiting_since", flat=True)[0]
        )
        await until(
            lambda: ClusterAttempt.objects.filter(
                cluster_job_id=cluster, started_at__isnull=False
            ).exists(),
            timeout=30,
        )

    def rows():
        submitted = ClusterJob.objects.get(pk=cluster).created_at
        [reservation] = ClusterReservation.objects.filter(cluster_job_id=cluster)
        [attempt] = ClusterAttempt.objects.filter(cluster_job_id=cluster)
        seats = set(reservation.seats.values_list("worker_id", flat=True))
        singles = list(
            DispatchedJob.objects.filter(cluster_attempt__isnull=True).order_by("dispatched_at")
        )
        members = set(attempt.dispatched_jobs.values_list("worker_id", flat=True))
        return submitted, reservation, attempt, seats, members, singles

    submitted, reservation, attempt, seats, members, singles = await q(rows)
    reserved_at, claimed_at = reservation.created_at, attempt.created_at

    # Its clock starts at the first pass that sees it, within an interval of the submission
    # (the test's submission wakes no pass of the stack's: its Celery app has another broker)
    # and that pass's latency; the first pass after RESERVE_AFTER on that clock reserves,
    # within another interval and its own latency.
    starting = (clock - submitted).total_seconds()
    assert 0 <= starting < INTERVAL + LATENCY, starting
    reserving = (reserved_at - clock).total_seconds()
    assert RESERVE_AFTER <= reserving < RESERVE_AFTER + INTERVAL + LATENCY, reserving
    # Never placed the ordinary way: the one attempt is the reservation's commit, on its seats.
    assert reservation.release_reason == "committed"
    assert claimed_at > reserved_at
    assert len(seats) == 4 and members == seats
    # Then every seat frees within one job length; the last one's RequestJob wakes the pass
    # that commits, and the members accept.
    started = (attempt.started_at - reserved_at).total_seconds()
    assert started < JOB_SECS[1] + LATENCY, started
    # So in all, it started within reserve-after + one job length + the slack: one interval
    # until a pass first sees it, one until the pass after reserve-after, and the latency
    # of that pass and of the commit's frames.
    waited = (attempt.started_at - submitted).total_seconds()
    assert waited < RESERVE_AFTER + JOB_SECS[1] + 2 * (INTERVAL + LATENCY), waited

    # No reserved seat got a single job while held.
    held = [s for s in singles if s.worker_id in seats and reserved_at <= s.dispatched_at]
    assert [s for s in held if s.dispatched_at < claimed_at] == []

    # The two unreserved workers kept taking singles throughout the hold: every single one of
    # them finished meanwhile was followed by its next within the latency.
    free = [s for s in singles if s.worker_id not in seats]
    finished = [s for s in free if s.finished_at and reserved_at <= s.finished_at <= claimed_at]
    for done in finished:
        following = [
            s for s in free if s.worker_id == done.worker_id and s.dispatched_at >= done.finished_at
        ]
        assert following, done.worker_id
        gap = (following[0].dispatched_at - done.finished_at).total_seconds()
        assert gap < LATENCY, (done.worker_id, gap)
    # Busy all along with jobs of at most JOB_SECS[1], each finished one per such length held.
    hold = (claimed_at - reserved_at).total_seconds()
    assert len(finished) >= 2 * int(hold // JOB_SECS[1]), (len(finished), hold)
