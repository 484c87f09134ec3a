"""Celery's broker transport: kombu's Redis transport, without a crash when Redis goes away.

On a lost broker connection the Celery worker closes it, and kombu's Redis channel, closing,
puts back the messages it had taken but not yet acknowledged. With the connection already
released, that restore fails (kombu 5.7: an AttributeError on the released connection's
parameters), the error escapes Celery's handling of connection errors, and the worker exits
("Unrecoverable error"). The fault suite saw both Celery workers exit at once on a Redis
restart, and no dispatch pass ran after it. The restore could not reach Redis anyway: the
messages stay in Redis's unacknowledged set, which kombu restores after its visibility
timeout, and every task of the service may run late or twice (each re-reads the database).
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
