"""The threads that run the sessions' database work, apart by what waits on them: a session's
frames, its reports and acceptances (the start path), its handshake."""

from concurrent.futures import ThreadPoolExecutor

from channels.db import database_sync_to_async
from django.conf import settings

# The frames' threads. A service mostly waits on PostgreSQL with the GIL released, so a few
# keep daphne's CPU busy; more take the GIL from the event loop, whose handshakes and Redis
# operations stall (a reconnect storm: docs/benchmarks.md). Each keeps its connection.
FRAME_THREADS = settings.FRAME_THREADS
frame_pool = ThreadPoolExecutor(FRAME_THREADS, thread_name_prefix="frames")


def db(fn):
    # Not thread-sensitive: sessions' services run side by side on the executor's threads
    # instead of queueing behind each other on one.
    return database_sync_to_async(fn, thread_sensitive=False, executor=frame_pool)


# The start path's own threads: reports and signals, each one short transaction that settles
# a member or frees a slot. Behind a busy fleet's offers and RequestJobs they would wait long
# enough for prepares to time out (docs/benchmarks.md). More take daphne's GIL from the event
# loop: six cost single jobs about a tenth (docs/design.md).
REPORT_THREADS = settings.REPORT_THREADS
report_pool = ThreadPoolExecutor(REPORT_THREADS, thread_name_prefix="reports")


def report_db(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=report_pool)


# Acceptances apart from the reports: every member of an attempt stays held until the last
# one's acceptance is read, while a report delays one slot only. Behind a cluster-heavy
# fleet's completions (each settles its member), acceptances waited seconds. Each one mostly
# waits on PostgreSQL, and with four a fleet of 1,000 fell behind its claims (docs/design.md).
ACCEPT_THREADS = settings.ACCEPT_THREADS
accept_pool = ThreadPoolExecutor(ACCEPT_THREADS, thread_name_prefix="accepts")


def accept_db(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=accept_pool)


# The session start's own threads (authenticate, attach, capabilities): daphne refuses a
# WebSocket not accepted within 5 s, so in a reconnect storm a start must not queue behind the
# open sessions' frames. Each keeps its connection: opening one is the slowest part of a start.
HANDSHAKE_THREADS = 4
handshake_pool = ThreadPoolExecutor(HANDSHAKE_THREADS, thread_name_prefix="handshake")


def handshake_db(fn):
    return database_sync_to_async(fn, thread_sensitive=False, executor=handshake_pool)


POOLS = (frame_pool, report_pool, accept_pool, handshake_pool)
