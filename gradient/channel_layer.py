"""The Channels layer on Redis, sized for a reconnect storm and a busy fleet.

channels-redis's plain pool fails with "Too many connections" when a storm's sessions join
their groups at once; a blocking pool waits for a free connection instead.

channels-redis takes a process's inbox one message at a time, four round trips each, so under
a busy fleet the sessions' frames waited in it. Here a pop also takes what else is waiting, up
to RECEIVE_BATCH. Without the backup copy a message popped by a process that then dies is lost,
as in a Redis that restarts: every frame the layer carries is a wake-up whose state is in
PostgreSQL.

group_send_many sends to many groups at once, for the passes that reach hundreds of workers.
"""

import collections
import time

from channels_redis.core import RedisChannelLayer
from redis.asyncio import BlockingConnectionPool

RECEIVE_BATCH = 256


# Each message goes to its key only while the key holds fewer than its capacity; ARGV holds
# the messages, then the capacities, then the scores (one each, rising, so that a key's
# messages are popped in the order they were given), then the keys' expiry. Returns how many
# were dropped for capacity.
SEND_MANY_LUA = """
local n = #KEYS
local dropped = 0
for i = 1, n do
    if redis.call('ZCARD', KEYS[i]) < tonumber(ARGV[n + i]) then
        redis.call('ZADD', KEYS[i], ARGV[2 * n + i], ARGV[i])
        redis.call('EXPIRE', KEYS[i], ARGV[3 * n + 1])
    else
        dropped = dropped + 1
    end
end
return dropped
"""


class BlockingRedisChannelLayer(RedisChannelLayer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._popped: collections.defaultdict = collections.defaultdict(collections.deque)

    def create_pool(self, index):
        host = dict(self.hosts[index])
        return BlockingConnectionPool.from_url(host.pop("address"), **host)

    async def receive_single(self, channel):
        """One message off the channel: the oldest popped before, or a pop that takes the others
        waiting with it (off the process's inbox, handed straight to their sessions' buffers)."""
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
            if channel.endswith("!"):
                self._hand_out(popped)
        return self._unpack(channel, popped.popleft())

    def _hand_out(self, popped: collections.deque) -> None:
        """Every message popped off the inbox but the last into its session's buffer at once, rather
        than each waiting for a turn of the receive lock among hundreds of sessions."""
        while len(popped) > 1:
            channel, message = self._unpack(None, popped.popleft())
            for name in channel if isinstance(channel, list) else [channel]:
                self.receive_buffer[name].put_nowait(message)

    def _unpack(self, channel, body: bytes):
        message = self.deserialize(body)
        if "__asgi_channel__" in message:
            channel = message.pop("__asgi_channel__")
        return channel, message

    async def group_add(self, group, channel):
        """channels-redis's group_add in one round trip instead of two: every session joins again at
        each touch."""
        assert self.require_valid_group_name(group), "Group name not valid"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        key = self._group_key(group)
        pipe = self.connection(self.consistent_hash(group)).pipeline(transaction=False)
        pipe.zadd(key, {channel: time.time()})
        pipe.expire(key, self.group_expiry)
        await pipe.execute()

    async def group_send_many(self, sends: list[tuple[str, dict]]) -> int:
        """Send each (group, message) as group_send would, in two round trips per Redis host instead
        of four per group; how many were dropped for a full channel."""
        members = await self._group_members([group for group, _ in sends])
        per_host: dict[int, list[tuple[str, bytes, int]]] = collections.defaultdict(list)
        for (_, message), channels in zip(sends, members, strict=True):
            by_host, serialized, capacity = self._map_channel_keys_to_connection(channels, message)
            for index, keys in by_host.items():
                per_host[index] += [(key, serialized[key], capacity[key]) for key in keys]
        dropped = 0
        for index, items in per_host.items():
            connection = self.connection(index)
            stale = int(time.time()) - int(self.expiry)
            pipe = connection.pipeline(transaction=False)
            for key in dict.fromkeys(key for key, _, _ in items):
                pipe.zremrangebyscore(key, min=0, max=stale)
            now = time.time()
            pipe.eval(
                SEND_MANY_LUA,
                len(items),
                *(key for key, _, _ in items),
                *(body for _, body, _ in items),
                *(capacity for _, _, capacity in items),
                *(now + i * 1e-6 for i in range(len(items))),
                self.expiry,
            )
            dropped += (await pipe.execute())[-1]
        return dropped

    async def _group_members(self, groups: list[str]) -> list[list[str]]:
        """Each group's channels, its expired ones discarded first, one pipeline per host."""
        out: list[list[str]] = [[] for _ in groups]
        by_host: dict[int, list[int]] = collections.defaultdict(list)
        for i, group in enumerate(groups):
            by_host[self.consistent_hash(group)].append(i)
        expired = int(time.time()) - self.group_expiry
        for index, positions in by_host.items():
            pipe = self.connection(index).pipeline(transaction=False)
            for i in positions:
                key = self._group_key(groups[i])
                pipe.zremrangebyscore(key, min=0, max=expired)
                pipe.zrange(key, 0, -1)
            replies = await pipe.execute()
            for i, names in zip(positions, replies[1::2], strict=True):
                out[i] = [name.decode() for name in names]
        return out
