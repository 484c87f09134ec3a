import pytest


@pytest.fixture
def raw_sql(db):
    """Run one statement as written, bypassing every Python-side validation."""
    from django.db import connection

    def run(sql, params=None):
        with connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return cursor.rowcount

    return run
