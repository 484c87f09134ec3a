import os

import pytest

from gradient.redis_db import redis_url

# The unit tests' Redis database: a local bin/run uses database 0, and its sessions' groups are
# named by worker ids that the test database's workers share. e2e processes use their own.
UNIT_REDIS_DB = int(os.environ.get("GRADIENT_UNIT_REDIS_DB", "8"))


@pytest.fixture(scope="session", autouse=True)
def _unit_redis_db():
    """Wake-ups, Celery's queue, metrics, the Redis channel layer and the processes the tests
    start go to UNIT_REDIS_DB of the configured server. Set on the live settings: pytest-django
    loads them before any conftest, and each client is made on first use."""
    from django.conf import settings

    from gradient.celery import app

    url = redis_url(UNIT_REDIS_DB, settings.REDIS_URL)
    settings.REDIS_URL = settings.CELERY_BROKER_URL = app.conf.broker_url = url
    for layer in settings.CHANNEL_LAYERS.values():
        for host in layer.get("CONFIG", {}).get("hosts", ()):
            host["address"] = url
    os.environ["REDIS_URL"] = url


@pytest.fixture
def raw_sql(db):
    """Run one statement as written, bypassing every Python-side validation."""
    from django.db import connection

    def run(sql, params=None):
        with connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return cursor.rowcount

    return run


@pytest.fixture(autouse=True)
def _place_without_waiting_for_scores(settings):
    """Rows stand in for the workers in most tests, and rows answer no JobOffer: the pass
    places and the single path chooses at once (GRADIENT_SCORE_WAIT_MS=0) unless a test
    waits for scores itself."""
    settings.GRADIENT = {**settings.GRADIENT, "SCORE_WAIT_MS": 0}


@pytest.fixture
def analyzed(db):
    """ANALYZE of the cluster, job and score tables, for a test that reads plans over many
    rows. The row counts outlive the test's rows, rolled back or not: at its end the tables
    are emptied and analyzed again, so that the tests after it plan as for the tables they
    find."""
    from django.db import connection

    tables = "cluster_job, cluster_attempt, cluster_member, evaluation, derivation_build, job_score"
    with connection.cursor() as cursor:
        yield lambda: cursor.execute(f"ANALYZE {tables}")
        # Members and attempts go with their clusters (ON DELETE CASCADE).
        for table in ("cluster_job", "evaluation", "derivation_build", "job_score"):
            cursor.execute(f"DELETE FROM {table}")
        cursor.execute(f"ANALYZE {tables}")


@pytest.fixture
def memory_layer(settings):
    """Channels' in-memory layer, for unit tests of one process."""
    from channels.layers import channel_layers

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture(scope="session", autouse=True)
def _connections_close_after_each_use():
    """Sessions run their services on executor threads, each with its own connection; kept
    open (as in production) they would outlive the test database. Close them after each use."""
    from django.db import connections

    connections.settings["default"]["CONN_MAX_AGE"] = 0
    for conn in connections.all(initialized_only=True):
        conn.settings_dict["CONN_MAX_AGE"] = 0


@pytest.fixture(scope="session", autouse=True)
def _session_pools_close_their_connections(django_db_setup):
    """Before the test database is dropped, every thread of the sessions' executors closes
    its connection (one left open by a late frame would keep the database from being dropped
    and leave it behind)."""
    yield
    import threading

    from django.db import connections

    from sessions import threads

    for pool in threads.POOLS:
        # As many tasks as the pool has threads, each held at a barrier until all run: every
        # thread (started now if it was not yet) takes exactly one.
        barrier = threading.Barrier(pool._max_workers)

        def close(barrier=barrier):
            barrier.wait(timeout=30)
            connections.close_all()

        for future in [pool.submit(close) for _ in range(pool._max_workers)]:
            future.result(timeout=60)
