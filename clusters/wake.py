"""Waking the dispatch pass between its periodic runs: coalesced in Redis, so a burst of
unanswered RequestJobs queues one pass, by its task's name alone."""

import logging

import redis
from django.conf import settings
from django.db import DatabaseError, connection
from django.utils import timezone

from clusters import statements
from gradient.celery import app

log = logging.getLogger(__name__)

DISPATCH_TASK = "clusters.dispatch"
WAKE_KEY = "gradient:dispatch:queued"
_redis = None


def _client():
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1)
    return _redis


def clusters_waiting() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute(statements.WAITING_SQL)
            return cursor.fetchone()[0]
    except DatabaseError:
        return True  # not known: a needless pass costs less than a missed one


def wake_dispatch() -> bool:
    """Queue a dispatch pass unless one is queued and not yet started, or no cluster waits for
    seats. Best effort: the periodic pass makes up for a lost wake-up."""
    try:
        client = _client()
        # Under a busy fleet a pass is nearly always queued: one Redis read then spares each
        # unanswered RequestJob the database's look at the queue.
        if client.exists(WAKE_KEY) or not clusters_waiting():
            return False
        if not client.set(WAKE_KEY, 1, nx=True, ex=10):
            return False
        app.send_task(DISPATCH_TASK, kwargs={"woken": True})
    except Exception:
        log.warning("could not wake the dispatch pass", exc_info=True)
        return False
    return True


DUE_KEY = "gradient:dispatch:due"


def run_at(when) -> None:
    """Queue a pass for `when`, unless one is queued for about then already: passes queued back to
    back would each wait for the lock. Best effort: the periodic pass makes up for a lost one."""
    try:
        delay = max(0.0, (when - timezone.now()).total_seconds())
        if _client().set(DUE_KEY, 1, nx=True, px=max(1, int(delay * 1000))):
            app.send_task(DISPATCH_TASK, kwargs={"woken": True}, countdown=delay)
    except Exception:
        log.warning("could not queue the dispatch pass", exc_info=True)


def clear_wake() -> None:
    """Called as a woken pass starts: a wake-up from now on queues another pass."""
    try:
        _client().delete(WAKE_KEY)
    except Exception:
        log.warning("could not clear the dispatch wake-up", exc_info=True)
