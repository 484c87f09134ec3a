"""gradient.broker: closing a Redis channel whose connection was already released (a lost
broker) leaves its unacknowledged messages in Redis instead of raising, so the Celery worker
reconnects rather than exits. Through real Redis (its test database)."""

import logging

import kombu
import pytest
import redis

from gradient.redis_db import redis_url
from tests.test_metrics import TEST_REDIS_DB

QUEUE = "gradient-test-broker"


@pytest.fixture
def taken(caplog):
    """A channel holding one message taken and not acknowledged."""
    caplog.set_level(logging.WARNING, logger="gradient.broker")
    direct = redis.Redis.from_url(redis_url(TEST_REDIS_DB))
    direct.flushdb()
    connection = kombu.Connection(redis_url(TEST_REDIS_DB), transport="gradient.broker:Transport")
    queue = connection.SimpleQueue(QUEUE)
    queue.put({"task": "clusters.dispatch"})
    message = queue.get(timeout=5)
    assert message.payload == {"task": "clusters.dispatch"}
    yield queue.channel, direct
    connection.release()
    direct.flushdb()


def test_a_channel_closed_after_its_connection_was_released_keeps_its_messages(taken, caplog):
    channel, direct = taken
    assert direct.hlen(channel.unacked_key) == 1
    channel.connection.client = None  # as kombu leaves it after the broker connection died
    channel.close()
    assert "1 unacknowledged message(s) left" in caplog.text
    assert direct.hlen(channel.unacked_key) == 1  # for kombu's restore after its timeout


def test_a_clean_close_still_puts_the_message_back_at_once(taken, caplog):
    channel, direct = taken
    channel.close()
    assert direct.hlen(channel.unacked_key) == 0
    assert direct.llen(QUEUE) == 1
    assert "unacknowledged" not in caplog.text
