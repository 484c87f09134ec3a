"""Django's PostgreSQL backend, with CONN_HEALTH_CHECKS at most once a second per connection,
and psycopg's placeholder conversion kept for our longest statements too.

Every database_sync_to_async call is a request, and Django checks a reused connection (a round
trip) at the start of each. One checked or opened less than a second ago is trusted; one idle
for longer (PostgreSQL may have restarted) is still checked.
"""

import time

from django.db.backends.postgresql import base
from psycopg import _queries

TRUSTED_FOR_SECS = 1.0

# psycopg caches its placeholder conversion only below a size limit, which the head of the
# queue's statement passes.
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
