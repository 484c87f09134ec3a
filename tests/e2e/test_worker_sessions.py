"""A real daphne on Redis, a real WebSocket client: the single path end to end."""

import asyncio
import json

import pytest
import websockets
from asgiref.sync import sync_to_async
from django.db import connection
from websockets.asyncio.client import connect

from gradient.jobs.models import BuildStatus, DerivationBuild, DispatchedJob
from tests.factories import BuildFactory, WorkerFactory
from workers.models import IdleSlot, Worker, hash_token

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

CAPS = {
    "type": "WorkerCapabilities",
    "architectures": ["x86_64-linux"],
    "system_features": [],
    "max_concurrent_builds": 1,
    "max_concurrent_evals": 1,
    "eval": True,
    "build": True,
    "fetch": False,
    "zone": None,
    "endpoint": None,
}


def q(fn):
    def run():
        try:
            return fn()
        finally:
            connection.close()  # no connection left behind to block the test database's drop

    return sync_to_async(run)()


async def until(check, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not await q(check):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def recv_type(ws, name, timeout=5.0):
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if frame["type"] == name:
            return frame


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


async def test_an_unknown_token_is_refused_with_403(stack):
    url = stack
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        async with connect(url, additional_headers=bearer("nobody")):
            pass
    assert refused.value.response.status_code == 403


async def test_a_single_job_is_assigned_completed_and_its_idle_slot_recorded_then_cleared(stack):
    await q(lambda: WorkerFactory(name="e2e", token_hash=hash_token("t-e2e")))
    url = stack
    async with connect(url, additional_headers=bearer("t-e2e")) as ws:
        await ws.send(json.dumps(CAPS))
        assert (await recv_type(ws, "InitAck"))["worker"] == "e2e"
        await ws.send(json.dumps({"type": "RequestJob", "kind": "build"}))
        await until(lambda: IdleSlot.objects.filter(kind="build").exists())

        build = await q(lambda: BuildFactory())
        await ws.send(json.dumps({"type": "RequestJob", "kind": "build"}))
        assigned = await recv_type(ws, "AssignJob")
        assert assigned["job_id"] == f"build:{build.pk}"
        assert not await q(lambda: IdleSlot.objects.exists())
        await ws.send(
            json.dumps(
                {"type": "AssignJobResponse", "job_id": assigned["job_id"], "accepted": True}
            )
        )
        await ws.send(
            json.dumps(
                {
                    "type": "JobCompleted",
                    "job_id": assigned["job_id"],
                    "assignment_id": assigned["assignment_id"],
                    "elapsed_ms": 12,
                }
            )
        )
        await until(lambda: DerivationBuild.objects.get().status == BuildStatus.COMPLETED)
    assert await q(lambda: DispatchedJob.objects.get().outcome) == "Completed"


async def test_a_disconnect_requeues_the_workers_job(stack):
    await q(lambda: WorkerFactory(name="leaver", token_hash=hash_token("t-leaver")))
    build = await q(lambda: BuildFactory())
    url = stack
    async with connect(url, additional_headers=bearer("t-leaver")) as ws:
        await ws.send(json.dumps(CAPS))
        await recv_type(ws, "InitAck")
        await ws.send(json.dumps({"type": "RequestJob", "kind": "build"}))
        await recv_type(ws, "AssignJob")
        assert await q(lambda: DerivationBuild.objects.get().status) == BuildStatus.BUILDING
    await until(lambda: DerivationBuild.objects.get(pk=build.pk).status == BuildStatus.QUEUED)
    assert await q(lambda: DispatchedJob.objects.get().outcome) == "Abandoned"
    assert await q(lambda: Worker.objects.get().channel_name) is None
