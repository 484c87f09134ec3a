"""Cluster dispatch end to end: daphne, a Celery worker and beat, Redis and PostgreSQL, and a
fleet of reference workers over real WebSockets."""

from dataclasses import replace

import pytest

from clusters.models import ClusterAttempt, ClusterJob, ClusterStatus
from clusters.submission import parse_member, submit_cluster
from gradient.jobs.models import DispatchedJob
from tests.e2e.fleet import fleet, members_held_twice, q, until
from tests.factories import ProjectFactory
from workers.models import IdleSlot

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


async def submit(*specs, same_zone=False, retry_budget=0):
    def create():
        ProjectFactory(name="e2e")
        cluster, _ = submit_cluster(
            "e2e",
            [parse_member(s) for s in specs],
            same_zone=same_zone,
            retry_budget=retry_budget,
        )
        return cluster.pk

    return await q(create)


def history(cluster_id):
    from clusters.history import describe_cluster

    return describe_cluster(ClusterJob.objects.get(pk=cluster_id))["history"]


def finished(cluster_id):
    status = ClusterJob.objects.values_list("status", flat=True).get(pk=cluster_id)
    return status if status not in (ClusterStatus.QUEUED, ClusterStatus.RUNNING) else None


async def test_a_same_zone_cluster_with_a_pinned_member_starts_where_expected_and_completes(
    stack,
):
    specs = {
        "a1": {"zone": "a"},
        "a2": {"zone": "a"},
        "b1": {"zone": "b"},
        "b2": {"zone": "b"},
    }
    async with fleet(stack, specs) as workers:
        cluster = await submit("server:eval:pin=b2", "client:build", same_zone=True)
        assert await until(lambda: finished(cluster)) == ClusterStatus.COMPLETED
        attempts = await q(lambda: history(cluster))
        assert len(attempts) == 1, attempts
        [attempt] = attempts
        seats = {s["role"]: s["worker"] for s in attempt["seats"]}
        assert seats["server"] == "b2" and seats["client"] == "b1"
        assert attempt["outcome"] == "Succeeded"
        starts = [e for w in workers.values() for e in w.events if e["event"] == "started"]
        assert len(starts) == 2
        assert {tuple(sorted(r["worker"] for r in e["roster"])) for e in starts} == {("b1", "b2")}
        assert members_held_twice(workers) == []


def zone_cost(cost):
    return lambda name, job: (1, cost)


async def test_a_cluster_meeting_an_idle_fleet_is_seated_on_the_cheapest_zone_every_time(stack):
    """Zone b's workers have every member's closure nearly complete but answer their offers
    later than zone a's: the pass waits for their scores (GRADIENT_SCORE_WAIT_MS) rather than
    seat the cluster on the first answers or on ties."""
    dear = {"zone": "a", "score": zone_cost(900 << 20)}
    cheap = {"zone": "b", "score": zone_cost(10 << 20), "score_secs": 0.3}
    specs = {"a1": dear, "a2": dear, "a3": dear, "b1": cheap, "b2": cheap}
    async with fleet(stack, specs):
        await until(lambda: IdleSlot.objects.filter(kind="build").count() == 5, timeout=20)
        zones = []
        for _ in range(20):
            cluster = await submit("server:build", "client:build", same_zone=True)
            assert await until(lambda c=cluster: finished(c), timeout=30) == "Completed"
            [attempt] = await q(lambda c=cluster: history(c))
            zones.append("".join(sorted(s["worker"][0] for s in attempt["seats"])))
        assert zones == ["bb"] * 20, zones


async def test_a_rejecting_member_aborts_the_attempt_and_the_cluster_starts_later(stack):
    async with fleet(stack, {"picky": {"reject_rate": 1.0}, "eager": {}}) as workers:
        cluster = await submit("server:eval", "client:build")
        await workers["picky"].wait_event("rejected", timeout=20)
        workers["picky"].config = replace(workers["picky"].config, reject_rate=0.0)
        assert await until(lambda: finished(cluster)) == ClusterStatus.COMPLETED
        outcomes = [a["outcome"] for a in await q(lambda: history(cluster))]
        assert outcomes[0] == "PrepareFailed" and outcomes[-1] == "Succeeded"
        cluster_row = await q(lambda: ClusterJob.objects.get(pk=cluster))
        assert cluster_row.attempts == 1  # a failed prepare spends no attempt
        aborted = await workers["eager"].wait_event("released_hold", reason="abort_cluster")
        assert aborted["attempt"] is not None


async def test_a_member_whose_worker_never_answers_times_the_attempt_out(stack):
    async with fleet(stack, {"hung": {"answers_members": False}, "ok": {}}) as workers:
        cluster = await submit("server:eval", "client:build")
        held = await workers["hung"].wait_event("held", timeout=20)
        failed = await until(
            lambda: ClusterAttempt.objects.filter(
                pk=held["attempt"], outcome="PrepareFailed"
            ).exists(),
            timeout=15,
        )
        assert failed
        # Both workers let go of their holds: the hung one too, once told (or at hold_secs).
        for name in ("hung", "ok"):
            await workers[name].wait_event("released_hold", attempt=held["attempt"], timeout=20)
        assert await q(
            lambda: (
                not DispatchedJob.objects.filter(
                    cluster_attempt_id=held["attempt"], finished_at__isnull=True
                ).exists()
            )
        )
        assert await q(lambda: ClusterJob.objects.get(pk=cluster).attempts) == 0


async def test_a_signal_reaches_exactly_its_addressees(stack):
    slow = {"job_secs": (6.0, 6.0)}
    async with fleet(stack, {"s": slow, "c0": slow, "c1": slow}) as workers:
        await submit("server:eval", "client:build", "client:build")
        starts = {name: await w.wait_event("started", timeout=30) for name, w in workers.items()}
        attempt = starts["s"]["attempt"]
        role_of = {}
        for name, w in workers.items():
            held = next(e for e in w.events if e["event"] == "held")
            role_of[(held["role"], held["index"])] = name
        sender = role_of[("server", 0)]
        target = role_of[("client", 1)]
        assert await workers[sender].send_signal(attempt, {"ready": True}, to=("client", 1))
        got = await workers[target].wait_event("signal_received", timeout=10)
        assert got["from"] == {"role": "server", "index": 0}
        await workers[role_of[("client", 0)]].send_signal(attempt, "hello all")
        for name in (sender, target):
            await workers[name].wait_event("signal_received", payload="hello all", timeout=10)
        received = {name: [s["payload"] for s in w.signals] for name, w in workers.items()}
        assert received[sender] == ["hello all"]
        assert received[target] == [{"ready": True}, "hello all"]
        assert received[role_of[("client", 0)]] == []


async def test_no_worker_ever_holds_two_members_of_one_attempt(stack):
    # Three workers, each able to take both kinds, and clusters of three members: every seat
    # must be a distinct worker however the slots line up.
    specs = {f"w{i}": {"max_builds": 2, "max_evals": 2} for i in range(3)}
    async with fleet(stack, specs) as workers:
        ids = [await submit("a:eval", "b:build", "c:build") for _ in range(4)]
        for cluster in ids:
            assert await until(lambda c=cluster: finished(c), timeout=60) == "Completed"
        assert members_held_twice(workers) == []
        for cluster in ids:
            for attempt in await q(lambda c=cluster: history(c)):
                seated = [s["worker"] for s in attempt["seats"]]
                assert len(seated) == len(set(seated)) == 3
