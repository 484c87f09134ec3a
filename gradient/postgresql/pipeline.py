"""Statements sent together in one round trip (a psycopg pipeline)."""

from django.db import connection


def send(sql: str, params=None):
    """Execute on a cursor of its own: in a pipeline, its result is read after the sync."""
    cursor = connection.cursor()
    cursor.execute(sql, params)
    return cursor
