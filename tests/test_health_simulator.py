"""simulate_workers --flaky-rate: a share of the fleet rejects or loses its cluster members."""

import asyncio

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from gradient.wire import protocol as p
from tests.fake_server import BUILDER, FakeServer, assign, hold, ready, roster
from workers.management.commands.simulate_workers import FLAKY_WAYS, flaky_workers


def test_the_flaky_share_is_spread_over_the_fleet_and_takes_each_way_in_turn():
    names = [f"sim-{i}" for i in range(50)]
    flaky = flaky_workers(names, 0.1)
    assert list(flaky) == [f"sim-{i}" for i in range(0, 50, 10)]
    reject, lose = FLAKY_WAYS["reject"], FLAKY_WAYS["lose"]
    assert list(flaky.values()) == [reject, lose, reject, lose, reject]
    assert flaky_workers(names, 0.0) == {}
    assert len(flaky_workers(names, 1.0)) == 50


@pytest.mark.parametrize("share", ["-0.1", "1.5"])
def test_a_flaky_rate_outside_zero_to_one_is_refused(share):
    with pytest.raises(CommandError, match="--flaky-rate must be between 0 and 1"):
        call_command("simulate_workers", "--count", "2", "--flaky-rate", share)


@pytest.mark.asyncio
async def test_a_worker_that_loses_its_members_drops_its_connection_at_the_start():
    from dataclasses import replace

    async with FakeServer() as server:
        worker, task, session = await ready(server, replace(BUILDER, loses_members=True))
        try:
            await session.send(assign(cluster=hold()))
            assert (await session.expect(p.AssignJobResponse)).accepted
            await session.send(roster())
            # The connection drops before the member runs: it comes back without it.
            again = await asyncio.wait_for(server.sessions.get(), 5)
            await again.handshake()
            assert worker.jobs == {}
            assert any(e["event"] == "losing_members" for e in worker.events)
            # Single jobs still run.
            await again.expect(p.RequestJob)
            await again.send(assign(job_id="build:00000000-0000-4000-8000-000000000002"))
            assert (await again.expect(p.AssignJobResponse)).accepted
        finally:
            await worker.stop()
            await asyncio.wait_for(task, 5)
