"""Django's PostgreSQL backend, with CONN_HEALTH_CHECKS at most once a second per connection,
and psycopg's placeholder conversion kept for our longest statements too.

Django checks a reused connection (a `SELECT 1` round trip) at the start of every request, and
every database_sync_to_async call is a request: a session's frame that needs one statement
paid two round trips. A connection that passed a check, or was opened, less than a second ago
is trusted instead; one idle for longer (the case the checks are for: PostgreSQL restarted
meanwhile) is still checked before use.
"""

import time

from django.db.backends.postgresql import base
from psycopg import _queries

TRUSTED_FOR_SECS = 1.0

# psycopg converts a statement's %(name)s placeholders once and keeps the result only for a
# text below a size limit (against ORMs' one-off statements). The head of the queue's statement
# is past it, so every RequestJob would pay the conversion again.
STATEMENTS_CACHED_UP_TO = 16 * 1024
_queries.MAX_CACHED_STATEMENT_LENGTH = max(
    _queries.MAX_CACHED_STATEMENT_LENGTH, STATEMENTS_CACHED_UP_TO
)


class DatabaseWrapper(base.DatabaseWrapper):
    checked_at = float("-inf")

    def connect(self):
        super().connect()
        self.checked_at = time.monotonic()

    def close_if_health_check_failed(self):
        if self.connection is not None and not self.health_check_done:
            now = time.monotonic()
            if now - self.checked_at < TRUSTED_FOR_SECS:
                self.health_check_done = True
                return
            self.checked_at = now
        super().close_if_health_check_failed()
