"""A bug the fault suite found, pinned down in one process: after a Redis restart a session that
stayed connected was no longer in its worker's group (groups live in Redis), so the passes'
AssignJob and StartCluster never reached it and every prepare seating it timed out, for as long
as the session lived. A live session now joins its group again at each liveness touch."""

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer

from gradient.wire.groups import worker_group
from sessions import presence
from tests.factories import WorkerFactory
from tests.sessions.conftest import Session
from workers.models import IdleSlot, Worker, hash_token

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]


async def test_a_live_session_gets_back_into_its_group_after_the_layer_lost_it(
    memory_layer, monkeypatch
):
    monkeypatch.setattr(presence, "TOUCH_EVERY_SECS", 0.0)  # every frame is a liveness touch
    worker = await sync_to_async(WorkerFactory)(name="w", token_hash=hash_token("t"))
    session = Session("t")
    assert (await session.connect())[0]
    await session.hello()
    channel = await sync_to_async(
        lambda: Worker.objects.values_list("channel_name", flat=True).get(pk=worker.pk)
    )()
    layer = get_channel_layer()
    group = worker_group(worker.pk)
    await layer.group_discard(group, channel)  # what a Redis restart does to every group

    # Any frame is a touch; a RequestJob (nothing to do: an idle slot) queues behind it.
    await session.send({"type": "RequestJob", "kind": "build"})
    for _ in range(100):
        if await sync_to_async(IdleSlot.objects.filter(worker=worker).exists)():
            break  # the touch before it was handled
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the RequestJob after the touch was not handled")
    frame = json.dumps({"type": "Error", "code": "probe", "message": "through the group"})
    await layer.group_send(group, {"type": "worker.send", "frame": frame})
    assert (await session.recv_type("Error"))["code"] == "probe"
    await session.close()


async def test_a_session_whose_daphne_died_leaves_the_group_when_its_worker_returns(
    memory_layer,
):
    worker = await sync_to_async(WorkerFactory)(name="w", token_hash=hash_token("t"))
    layer = get_channel_layer()
    group = worker_group(worker.pk)
    # What a killed daphne leaves behind: the worker attached to a channel nobody reads, still
    # in the worker's group.
    dead = await layer.new_channel()
    await layer.group_add(group, dead)
    await sync_to_async(Worker.objects.filter(pk=worker.pk).update)(channel_name=dead)

    session = Session("t")
    assert (await session.connect())[0]
    await session.hello()
    assert dead not in layer.groups.get(group, {})
    frame = json.dumps({"type": "Error", "code": "probe", "message": "through the group"})
    await layer.group_send(group, {"type": "worker.send", "frame": frame})
    assert (await session.recv_type("Error"))["code"] == "probe"
    await session.close()
