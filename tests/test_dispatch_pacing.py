"""Woken dispatch passes are spaced (clusters.dispatch.pace_woken_pass), through real Redis."""

import time

import pytest
import redis

from clusters import dispatch
from tests.test_metrics import redis_url_for_tests


@pytest.fixture
def paced(monkeypatch):
    client = redis.Redis.from_url(redis_url_for_tests())
    client.delete(dispatch.WOKEN_AT_KEY)
    monkeypatch.setattr(dispatch, "_redis", client)
    yield client
    client.delete(dispatch.WOKEN_AT_KEY)


def test_a_pass_woken_right_after_another_waits_out_the_spacing(paced):
    assert dispatch.pace_woken_pass() == 0.0  # the first: at once
    began = time.monotonic()
    waited = dispatch.pace_woken_pass()
    assert 0.8 * dispatch.PASS_SPACING_SECS < waited <= dispatch.PASS_SPACING_SECS
    assert time.monotonic() - began >= waited


def test_a_pass_woken_after_a_quiet_spell_starts_at_once(paced):
    paced.set(dispatch.WOKEN_AT_KEY, repr(time.time() - 3 * dispatch.PASS_SPACING_SECS))
    assert dispatch.pace_woken_pass() == 0.0


def test_a_clock_ahead_never_makes_a_pass_wait_longer_than_the_spacing(paced):
    paced.set(dispatch.WOKEN_AT_KEY, repr(time.time() + 3600))
    assert dispatch.pace_woken_pass() == dispatch.PASS_SPACING_SECS


def test_without_redis_the_pass_starts_at_once(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_redis", redis.Redis(port=1, socket_timeout=1))
    assert dispatch.pace_woken_pass() == 0.0
    assert "could not pace" in caplog.text
