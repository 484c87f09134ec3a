"""The Channels layer on Redis, sized for a reconnect storm.

channels-redis builds a plain redis-py pool, which fails with "Too many connections" once
more than max_connections (100 by default) operations run at once, as when 1,000 workers
reconnect together and each session joins its group. A blocking pool waits for a free
connection instead.
"""

from channels_redis.core import RedisChannelLayer
from redis.asyncio import BlockingConnectionPool


class BlockingRedisChannelLayer(RedisChannelLayer):
    def create_pool(self, index):
        host = dict(self.hosts[index])
        return BlockingConnectionPool.from_url(host.pop("address"), **host)
