"""Celery's broker transport: kombu's Redis transport, without a crash when Redis goes away.

On a lost connection kombu's Redis channel, closing, restores its unacknowledged messages over
the connection already released; the error escapes Celery and the worker exits, so no dispatch
pass runs after a Redis restart. The messages stay in Redis's unacknowledged set and kombu
restores them after its visibility timeout anyway; every task re-reads the database.
"""

import logging

from kombu.transport import redis

log = logging.getLogger(__name__)


class QoS(redis.QoS):
    def restore_unacked(self, client=None):
        try:
            return super().restore_unacked(client)
        except AttributeError:
            if self.channel.connection.client is not None:
                raise  # not the released connection: a bug of its own
            log.warning(
                "broker connection gone: %d unacknowledged message(s) left for kombu to"
                " restore after its visibility timeout",
                len(self._delivered),
            )


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel
