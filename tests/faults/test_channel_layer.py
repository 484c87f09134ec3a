"""The channel layer across a Redis restart, on a redis-server of the test's own: the pool's
connections die with the server, and the first command on each used to fail with
ConnectionError. A pass's AssignJobs sent that way were lost, and their prepares timed out
(docs/reliability.md). The layer now reconnects and tries a failed command once more."""

import asyncio

import pytest
from django.conf import settings

from gradient.channel_layer import BlockingRedisChannelLayer
from tests.faults.services import PrivateRedis

pytestmark = pytest.mark.asyncio


async def test_a_send_after_a_redis_restart_reaches_its_channel(tmp_path):
    redis = PrivateRedis(tmp_path)
    redis.start()
    try:
        host = {**settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0], "address": redis.url}
        layer = BlockingRedisChannelLayer(hosts=[host])
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "before"})  # the pool's connection is open now
        assert (await layer.receive(channel))["type"] == "before"
        redis.restart()  # killed and started again, empty, on the same port
        await layer.send(channel, {"type": "after"})
        assert (await layer.receive(channel))["type"] == "after"
        await layer.close_pools()
    finally:
        redis.stop()


async def test_a_burst_to_the_sessions_of_one_process_is_delivered_whole(tmp_path):
    """Every session of a daphne process shares the process's inbox in Redis, and the layer's
    capacity counts per inbox: with the default of 100, a burst of frames to the sessions of
    one busy process was dropped past the hundredth."""
    redis = PrivateRedis(tmp_path)
    redis.start()
    try:
        host = {**settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0], "address": redis.url}
        capacity = settings.CHANNEL_LAYERS["default"]["CONFIG"]["capacity"]
        daphne = BlockingRedisChannelLayer(hosts=[host], capacity=capacity)
        sender = BlockingRedisChannelLayer(hosts=[host], capacity=capacity)  # a Celery pass
        sessions = [await daphne.new_channel() for _ in range(500)]
        for i, channel in enumerate(sessions):
            await daphne.group_add(f"worker-{i}", channel)
        for i in range(len(sessions)):
            await sender.group_send(f"worker-{i}", {"type": "worker.send", "frame": str(i)})
        got = []
        for channel in sessions:
            try:
                got.append((await asyncio.wait_for(daphne.receive(channel), 2))["frame"])
            except TimeoutError:
                break  # dropped
        assert got == [str(i) for i in range(len(sessions))]
        await daphne.close_pools()
        await sender.close_pools()
    finally:
        redis.stop()
