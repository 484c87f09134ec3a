"""gradient.postgresql: Django's health check (a round trip before a reused connection's
first query) at most once a second per connection, and still where it matters."""

import pytest
from django.db import connections


@pytest.fixture
def reused(db):
    """A second connection to the test database, kept between requests and health-checked
    (as in production: the test settings close connections after each use)."""
    conn = connections.create_connection("default")
    conn.settings_dict = {**conn.settings_dict, "CONN_MAX_AGE": 60, "CONN_HEALTH_CHECKS": True}
    checks = []
    usable = conn.is_usable

    def counted():
        checks.append(1)
        return usable()

    conn.is_usable = counted
    yield conn, checks
    conn.close()


def request(conn) -> int:
    """What a request (a database_sync_to_async call) does: close_old_connections, a query."""
    conn.close_if_unusable_or_obsolete()
    with conn.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def test_a_connection_checked_moments_ago_is_not_checked_again(reused):
    conn, checks = reused
    pid = request(conn)  # opens it: a new connection needs no check
    for _ in range(5):
        assert request(conn) == pid
    assert checks == []
    conn.checked_at -= 1.5
    assert request(conn) == pid
    assert request(conn) == pid
    assert checks == [1]  # once, then trusted again


def test_a_connection_idle_for_a_while_that_died_is_replaced_before_use(reused):
    conn, checks = reused
    pid = request(conn)
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    conn.checked_at -= 1.5
    assert request(conn) != pid  # checked, found dead, reopened: the query went through
    assert checks == [1]


def test_a_long_statement_is_converted_once_not_at_every_call(db):
    from psycopg import _queries

    from sessions.request_job import read_head
    from tests.factories import WorkerFactory
    from workers import offers

    worker = WorkerFactory()
    read_head(worker, offers.Offered(), ("build",))
    before = _queries._query2pg.cache_info()
    for _ in range(3):
        read_head(worker, offers.Offered(), ("build",))
    after = _queries._query2pg.cache_info()
    # The head's statement is longer than psycopg's own limit of 4 KiB, and is found cached.
    assert after.hits - before.hits >= 3
    assert after.misses == before.misses


@pytest.mark.django_db
def test_no_statement_is_jit_compiled():
    """Even one whose estimate passes jit_above_cost (here every one): compiling it at each
    run cost the cluster book more than it saved."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL jit_above_cost = 0")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) SELECT sum(g) FROM generate_series(1, 10) g")
        [[plan]] = cursor.fetchone()
    assert "JIT" not in plan
