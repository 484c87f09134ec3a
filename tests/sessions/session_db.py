"""The database as a /proto session test reads it: a query off the event loop, a table locked
by a connection of its own, and the rows a refused frame must leave as they were."""

import asyncio

import psycopg
from channels.db import database_sync_to_async
from django.db import connection

from gradient.jobs.models import DerivationBuild, DispatchedJob
from workers.models import IdleSlot, JobScore, Worker


def q(fn):
    # Channels' wrapper: the connection is closed after the call, so that none is left open
    # on asgiref's thread when the test database is dropped.
    return database_sync_to_async(fn)()


class TableLock:
    """An ACCESS EXCLUSIVE lock on a table, held by a connection of its own until released:
    every statement that reads the table waits for it."""

    def __init__(self, table: str):
        params = connection.get_connection_params()
        self.conn = psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"})
        self.conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        self.table = table

    def waiters(self) -> int:
        with psycopg.connect(self.conn.info.dsn, password=self.conn.info.password) as c:
            return c.execute(
                "SELECT count(*) FROM pg_locks WHERE relation = %s::regclass AND NOT granted",
                [self.table],
            ).fetchone()[0]

    def release(self):
        self.conn.rollback()
        self.conn.close()


async def eventually(check, timeout=5.0):
    for _ in range(int(timeout / 0.05)):
        if await q(check):
            return True
        await asyncio.sleep(0.05)
    return await q(check)


def snapshot():
    """Everything a refused frame must leave as it was."""
    return (
        list(DispatchedJob.objects.values_list("id", "finished_at", "outcome").order_by("id")),
        list(IdleSlot.objects.values_list("worker_id", "kind", "recorded_at").order_by("id")),
        list(
            JobScore.objects.values_list("worker_id", "job_id", "missing_nar_size").order_by(
                "worker_id", "job_id"
            )
        ),
        list(DerivationBuild.objects.values_list("id", "status").order_by("id")),
        list(
            Worker.objects.values_list("name", "zone", "draining", "architectures").order_by("id")
        ),
    )
