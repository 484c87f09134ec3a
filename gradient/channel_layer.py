"""The Channels layer on Redis, sized for a reconnect storm and a busy fleet.

channels-redis builds a plain redis-py pool, which fails with "Too many connections" once
more than max_connections (100 by default) operations run at once, as when 1,000 workers
reconnect together and each session joins its group. A blocking pool waits for a free
connection instead.

A daphne process receives every message for its sessions from one inbox in Redis, and
channels-redis takes them one at a time, four round trips each (a cleanup script, the pop, a
backup copy, its removal), with the next waiting for the last: under a busy fleet the frames
to the sessions (AssignJob, StartCluster, the dispatch pass's offers) waited seconds in that
inbox. Here a pop also takes what else is waiting, up to RECEIVE_BATCH, and hands it out
from memory. The backup copy goes: a message popped by a process that then dies is lost, as
a message in a Redis that restarts is; every frame the layer carries is a wake-up whose
state is in PostgreSQL.
"""

import collections

from channels_redis.core import RedisChannelLayer
from redis.asyncio import BlockingConnectionPool

RECEIVE_BATCH = 256


class BlockingRedisChannelLayer(RedisChannelLayer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._popped: collections.defaultdict = collections.defaultdict(collections.deque)

    def create_pool(self, index):
        host = dict(self.hosts[index])
        return BlockingConnectionPool.from_url(host.pop("address"), **host)

    async def receive_single(self, channel):
        """One message off the channel: the oldest of those popped before, or a pop that
        takes the others waiting with it."""
        assert self.require_valid_channel_name(channel, receive=True), "Channel name invalid"
        key = self.prefix + channel
        popped = self._popped[key]
        if not popped:
            if "!" in channel:
                index = self.consistent_hash(channel)
            else:
                index = next(self._receive_index_generator)
            connection = self.connection(index)
            while not popped:
                first = await connection.bzpopmin(key, timeout=self.brpop_timeout)
                if first is not None:
                    popped.append(first[1])
                    more = await connection.zpopmin(key, RECEIVE_BATCH - 1)
                    popped.extend(member for member, _ in more)
        message = self.deserialize(popped.popleft())
        if "__asgi_channel__" in message:
            channel = message.pop("__asgi_channel__")
        return channel, message
