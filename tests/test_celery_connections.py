"""A Celery pool process keeps its database connection from one task to the next, as a daphne
thread keeps its own from one frame to the next, and drops it once it broke or outlived
CONN_MAX_AGE. The tasks' signals are sent as a pool process sends them, around one statement,
with Celery's own Django fixup connected as a worker connects it."""

import time

import pytest
from celery.fixups.django import DjangoWorkerFixup
from celery.signals import task_postrun, task_prerun
from django.db import connection

from clusters.tasks import dispatch
from gradient.celery import app

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def kept_connections():
    """CONN_MAX_AGE as deployed (the suite closes its connections after each use)."""
    connection.close()
    connection.settings_dict["CONN_MAX_AGE"] = 300
    yield
    connection.settings_dict["CONN_MAX_AGE"] = 0
    connection.close()


@pytest.fixture(autouse=True)
def worker_fixup(kept_connections):
    fixup = DjangoWorkerFixup(app)
    task_prerun.connect(fixup.on_task_prerun)
    task_postrun.connect(fixup.on_task_postrun)
    yield fixup
    task_prerun.disconnect(fixup.on_task_prerun)
    task_postrun.disconnect(fixup.on_task_postrun)


def backend_of_a_task() -> int:
    """The PostgreSQL backend that served one task's statement."""
    task_prerun.send(sender=dispatch, task_id="t", task=dispatch, args=(), kwargs={})
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    task_postrun.send(sender=dispatch, task_id="t", task=dispatch, args=(), kwargs={})
    return pid


def test_consecutive_tasks_share_one_connection():
    first = backend_of_a_task()
    assert [backend_of_a_task() for _ in range(3)] == [first] * 3


def test_a_connection_past_conn_max_age_is_replaced_before_the_next_task():
    first = backend_of_a_task()
    connection.close_at = time.monotonic() - 1  # as CONN_MAX_AGE after the connection opened
    assert backend_of_a_task() != first


def test_a_broken_connection_is_replaced_before_the_next_task():
    first = backend_of_a_task()
    other = psycopg_connection()
    try:
        other.execute("SELECT pg_terminate_backend(%s)", [first])
    finally:
        other.close()
    connection.checked_at -= 60  # no longer trusted without a check (gradient/postgresql)
    assert backend_of_a_task() != first


def psycopg_connection():
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params.pop("server_side_binding", None)
    return psycopg.connect(**params, autocommit=True)
