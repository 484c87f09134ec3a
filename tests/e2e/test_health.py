"""Worker health end to end: daphne, a Celery worker and beat, and reference workers over real
WebSockets. A flaky worker is the cheapest seat of every cluster (its store has everything), so
the planner picks it whenever it may."""

import asyncio
from dataclasses import replace

import pytest
from django.utils import timezone

from clusters.worker_view import describe_worker
from tests.commands import manage
from tests.e2e.fleet import fleet, q, until
from tests.e2e.test_cluster_dispatch import finished, history, submit
from workers.health import is_quarantined
from workers.models import IdleSlot, Worker

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


def store(cost):
    return lambda name, job: (1, cost)


FLAKY = {"reject_rate": 1.0, "score": store(0)}
HEALTHY = {"score": store(500 << 20)}
FLEET = {"flaky": FLAKY, "w1": HEALTHY, "w2": HEALTHY, "w3": HEALTHY}


def shown(name="flaky") -> dict:
    return describe_worker(Worker.objects.get(name=name))


def quarantined(name="flaky") -> bool:
    return is_quarantined(Worker.objects.get(name=name), timezone.now())


async def run_cluster() -> list[dict]:
    """A cluster of two builds, run to its end; its attempts, oldest first."""
    await until(lambda: IdleSlot.objects.filter(kind="build").count() == 4, timeout=20)
    cluster = await submit("server:build", "client:build")
    assert await until(lambda: finished(cluster), timeout=40) == "Completed"
    return await q(lambda: history(cluster))


def seated(attempt) -> set[str]:
    return {s["worker"] for s in attempt["seats"]}


async def test_a_worker_rejecting_every_member_is_quarantined_after_the_third_attempt_it_ended(
    stack,
):
    async with fleet(stack, FLEET):
        for n in range(1, 4):
            attempts = await run_cluster()
            # Seated on the flaky worker first, which ended that attempt; the retry avoided it.
            assert attempts[0]["outcome"] == "PrepareFailed" and "flaky" in seated(attempts[0])
            assert attempts[-1]["outcome"] == "Succeeded" and "flaky" not in seated(attempts[-1])
            assert await q(quarantined) == (n == 3)
        worker = await q(shown)
        assert worker["quarantined"]["by"] == "automatic"
        assert worker["quarantined"]["reason"] == "3 blamed seats in a row, the last rejected"
        assert [s["blamed"] for s in worker["recent_seats"]] == [True, True, True]
        # The next clusters start on the others, at their first attempt.
        for _ in range(2):
            [attempt] = await run_cluster()
            assert attempt["outcome"] == "Succeeded" and "flaky" not in seated(attempt)


async def test_a_worker_whose_seat_succeeded_in_between_is_not_quarantined(stack):
    async with fleet(stack, FLEET) as workers:
        flaky = workers["flaky"]
        for _ in range(2):
            assert (await run_cluster())[0]["outcome"] == "PrepareFailed"
        flaky.config = replace(flaky.config, reject_rate=0.0)
        [attempt] = await run_cluster()
        assert "flaky" in seated(attempt)  # its seat succeeded
        flaky.config = replace(flaky.config, reject_rate=1.0)
        for _ in range(2):
            assert (await run_cluster())[0]["outcome"] == "PrepareFailed"
        worker = await q(shown)
        assert worker["quarantined"] is None
        assert worker["blamed_in_row"] == 2
        assert [s["blamed"] for s in worker["recent_seats"]] == [True, True, False, True, True]


QUARANTINE_SECS = 4


async def test_probation_and_release(processes):
    env = {"GRADIENT_QUARANTINE_SECS": QUARANTINE_SECS}
    url = processes.daphne(**env)
    processes.celery(**env)
    async with fleet(url, FLEET) as workers:
        for _ in range(3):
            await run_cluster()
        assert await q(quarantined)
        since = (await q(shown))["quarantined"]["since"]
        # Lifted after GRADIENT_QUARANTINE_SECS, on probation: seated again, and its next blamed
        # seat quarantines it again at once.
        await until(lambda: not quarantined(), timeout=QUARANTINE_SECS + 5)
        assert (await q(shown))["probation"] is True
        attempts = await run_cluster()
        assert attempts[0]["outcome"] == "PrepareFailed" and "flaky" in seated(attempts[0])
        worker = await q(shown)
        assert worker["quarantined"]["by"] == "automatic" and worker["quarantined"]["since"] > since
        assert worker["blamed_in_row"] == 4
        # An operator's release: no probation, and the planner seats it again at once.
        done = await asyncio.to_thread(manage, "quarantine_worker", "flaky", "--release")
        assert done.returncode == 0, done.stderr
        worker = await q(shown)
        assert worker["quarantined"] is None and worker["probation"] is False
        flaky = workers["flaky"]
        flaky.config = replace(flaky.config, reject_rate=0.0)
        [attempt] = await run_cluster()
        assert "flaky" in seated(attempt)
