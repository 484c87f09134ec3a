"""The channel layer across a Redis restart, on a redis-server of the test's own: the pool's
connections die with the server, and the first command on each used to fail with
ConnectionError. A pass's AssignJobs sent that way were lost, and their prepares timed out
(docs/reliability.md). The layer now reconnects and tries a failed command once more."""

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
