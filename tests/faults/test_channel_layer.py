"""The channel layer (gradient.channel_layer) on a redis-server of the test's own: across a
Redis restart, the pool's connections die with the server, and the first command on each used
to fail with ConnectionError (a pass's AssignJobs sent that way were lost, and their prepares
timed out: docs/reliability.md); a burst to one process's sessions; batched group sends; and
the hand-out of a process's inbox to its sessions."""

import asyncio

import pytest
from django.conf import settings

from gradient.channel_layer import BlockingRedisChannelLayer
from tests.faults.services import PrivateRedis

pytestmark = pytest.mark.asyncio


@pytest.fixture
def redis(tmp_path):
    """A redis-server of the test's own, with `host`: the layer's host settings for it."""
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        default = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]
        server.host = {**default, "address": server.url}
        yield server
    finally:
        server.stop()


async def test_a_send_after_a_redis_restart_reaches_its_channel(redis):
    layer = BlockingRedisChannelLayer(hosts=[redis.host])
    channel = await layer.new_channel()
    await layer.send(channel, {"type": "before"})  # the pool's connection is open now
    assert (await layer.receive(channel))["type"] == "before"
    redis.restart()  # killed and started again, empty, on the same port
    await layer.send(channel, {"type": "after"})
    assert (await layer.receive(channel))["type"] == "after"
    await layer.close_pools()


async def test_a_burst_to_the_sessions_of_one_process_is_delivered_whole(redis):
    """Every session of a daphne process shares the process's inbox in Redis, and the layer's
    capacity counts per inbox: with the default of 100, a burst of frames to the sessions of
    one busy process was dropped past the hundredth."""
    capacity = settings.CHANNEL_LAYERS["default"]["CONFIG"]["capacity"]
    daphne = BlockingRedisChannelLayer(hosts=[redis.host], capacity=capacity)
    sender = BlockingRedisChannelLayer(hosts=[redis.host], capacity=capacity)  # a Celery pass
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


async def test_group_send_many_delivers_as_group_send_in_order_and_within_capacity(redis):
    """A pass's frames to many workers' groups go in one batched send: each frame reaches every
    channel of its group (the sessions of two processes, a worker with two sessions), a
    channel's frames arrive in the order given, and a full inbox drops what exceeds it."""
    first = BlockingRedisChannelLayer(hosts=[redis.host], capacity=1000)
    second = BlockingRedisChannelLayer(hosts=[redis.host], capacity=1000)
    sender = BlockingRedisChannelLayer(hosts=[redis.host], capacity=1000)
    a, b = await first.new_channel(), await second.new_channel()
    both = await first.new_channel()
    await first.group_add("worker-a", a)
    await second.group_add("worker-b", b)
    await first.group_add("worker-both", both)
    await second.group_add("worker-both", b)
    sends = [("worker-a", {"type": "worker.send", "frame": f"a{i}"}) for i in range(300)]
    sends += [("worker-both", {"type": "worker.send", "frame": "to both"})]
    sends += [("worker-nobody", {"type": "worker.send", "frame": "lost"})]
    sends += [("worker-b", {"type": "worker.send", "frame": f"b{i}"}) for i in range(3)]
    assert await sender.group_send_many(sends) == 0
    got_a = [(await first.receive(a))["frame"] for _ in range(300)]
    assert got_a == [f"a{i}" for i in range(300)]
    assert (await first.receive(both))["frame"] == "to both"
    got_b = [(await second.receive(b))["frame"] for _ in range(4)]
    assert got_b == ["to both", "b0", "b1", "b2"]

    small = BlockingRedisChannelLayer(hosts=[redis.host], capacity=2)
    c = await first.new_channel()
    await first.group_add("worker-c", c)
    sends = [("worker-c", {"type": "worker.send", "frame": f"c{i}"}) for i in range(5)]
    assert await small.group_send_many(sends) == 3
    assert [(await first.receive(c))["frame"] for _ in range(2)] == ["c0", "c1"]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first.receive(c), 0.5)
    for layer in (first, second, sender, small):
        await layer.close_pools()


async def test_one_pop_puts_every_session_s_frame_in_its_buffer_at_once(redis):
    """A pop off a process's inbox takes up to a batch of frames for its sessions; each goes
    to its session's buffer then and there. Handed out one per receive() instead, each waited
    for a turn among hundreds of sessions: AssignJobs waited a second at 500 workers."""
    daphne = BlockingRedisChannelLayer(hosts=[redis.host], capacity=1000)
    sender = BlockingRedisChannelLayer(hosts=[redis.host], capacity=1000)
    sessions = [await daphne.new_channel() for _ in range(20)]
    for i, channel in enumerate(sessions):
        await daphne.group_add(f"worker-{i}", channel)
    sends = [
        (f"worker-{i}", {"type": "worker.send", "frame": f"{i}.{n}"})
        for n in (0, 1)
        for i in range(len(sessions))
    ]
    assert await sender.group_send_many(sends) == 0
    assert (await daphne.receive(sessions[0]))["frame"] == "0.0"
    for i, channel in enumerate(sessions):
        buffer = daphne.receive_buffer[channel]
        waiting = [buffer.get_nowait()["frame"] for _ in range(buffer.qsize())]
        assert waiting == ([f"{i}.1"] if i == 0 else [f"{i}.0", f"{i}.1"])
    await daphne.close_pools()
    await sender.close_pools()


async def test_group_add_joins_with_the_groups_expiry_and_joins_again_after_a_restart(redis):
    """group_add is one round trip of its own (the session's rejoin at every touch): the
    channel is a member, the group expires after group_expiry, a second join keeps one
    membership, and a join after a Redis restart reaches the channel again."""
    layer = BlockingRedisChannelLayer(hosts=[redis.host], group_expiry=600)
    sender = BlockingRedisChannelLayer(hosts=[redis.host])
    channel = await layer.new_channel()
    await layer.group_add("worker-1", channel)
    await layer.group_add("worker-1", channel)
    client = layer.connection(0)
    key = layer._group_key("worker-1")
    assert [name.decode() for name in await client.zrange(key, 0, -1)] == [channel]
    assert 590 <= await client.ttl(key) <= 600
    redis.restart()  # the group is gone with the server's memory
    assert await layer.connection(0).zcard(key) == 0
    await layer.group_add("worker-1", channel)
    await sender.group_send("worker-1", {"type": "found"})
    assert (await asyncio.wait_for(layer.receive(channel), 2))["type"] == "found"
    await layer.close_pools()
    await sender.close_pools()
