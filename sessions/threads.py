"""The threads that run the sessions' database work, apart by what waits on them: a session's
frames, its reports and acceptances (the start path), its handshake."""

from concurrent.futures import ThreadPoolExecutor

from channels.db import database_sync_to_async
from django.conf import settings

# The frames' threads: a few keep daphne's CPU busy; more take the GIL from the event loop.
FRAME_THREADS = settings.FRAME_THREADS
frame_pool = ThreadPoolExecutor(FRAME_THREADS, thread_name_prefix="frames")


def db(fn):
    # Not thread-sensitive: the services run side by side on the executor's threads.
    return database_sync_to_async(fn, thread_sensitive=False, executor=frame_pool)


# Reports and signals: behind a busy fleet's offers and RequestJobs they would wait long
# enough for prepares to time out (docs/benchmarks.md).
REPORT_THREADS = settings.REPORT_THREADS
report_pool = ThreadPoolExecutor(REPORT_THREADS, thread_name_prefix="reports")


def report_db(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=report_pool)


# Acceptances apart from the reports: an attempt's every member is held until the last one's
# acceptance is read, while a report delays one slot only (docs/design.md).
ACCEPT_THREADS = settings.ACCEPT_THREADS
accept_pool = ThreadPoolExecutor(ACCEPT_THREADS, thread_name_prefix="accepts")


def accept_db(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=accept_pool)


# The session start's own threads: daphne refuses a WebSocket not accepted in time, so a start
# must not queue behind the open sessions' frames.
HANDSHAKE_THREADS = 4
handshake_pool = ThreadPoolExecutor(HANDSHAKE_THREADS, thread_name_prefix="handshake")


def handshake_db(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=handshake_pool)


POOLS = (frame_pool, report_pool, accept_pool, handshake_pool)
