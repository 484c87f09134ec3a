"""Aging reservations end to end: a fleet kept busy by a stream of single jobs."""

import asyncio
import time

import pytest

from clusters.models import ClusterAttempt, ClusterReservation
from gradient.jobs.submission import JobSpec, create_jobs
from tests.e2e.fleet import fleet, q, until
from tests.e2e.test_cluster_dispatch import submit
from tests.factories import ProjectFactory

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

RESERVE_AFTER = 3
JOB_SECS = (1.5, 2.5)


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
    async with fleet(url, specs) as workers:
        # Every worker busy with singles before the cluster arrives.
        await until(lambda: all(w.running for w in workers.values()), timeout=20)
        began = time.monotonic()
        cluster = await submit("a:build", "b:build", "c:build", "d:build")
        started = await until(
            lambda: ClusterAttempt.objects.filter(
                cluster_job_id=cluster, started_at__isnull=False
            ).first(),
            timeout=30,
        )
        waited = time.monotonic() - began
        # Reserve after RESERVE_AFTER, then each seat frees within one job length.
        assert waited < RESERVE_AFTER + JOB_SECS[1] + 3, waited
        reservation = await q(lambda: ClusterReservation.objects.get(cluster_job_id=cluster))
        assert reservation.release_reason == "committed"
        seats = await q(lambda: set(reservation.seats.values_list("worker__name", flat=True)))
        assert len(seats) == 4
        # Singles kept flowing on the unreserved workers while the seats were held.
        held_from = reservation.created_at.timestamp()
        held_to = started.started_at.timestamp()
        flowing = [
            name
            for name, w in workers.items()
            if name not in seats
            and any(
                e["event"] == "completed"
                and held_from <= _ts(e["time"]) <= held_to + 0.5
                and not e.get("attempt")
                for e in w.events
            )
        ]
        assert flowing, "no single job completed on an unreserved worker meanwhile"
        await asyncio.sleep(0)


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()
