"""Reaching one worker's live session from any process: each session joins its worker's group
on the Channels layer."""

import asyncio
import logging
import os
import threading

from asgiref.sync import SyncToAsync, async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

SEND_TIMEOUT_SECS = 30.0


def worker_group(worker_id: int) -> str:
    return f"worker-{worker_id}"


class _SenderLoop:
    """One event loop per process, on a thread of its own, for sends from code that runs
    outside any loop (a Celery pass, a management command). async_to_sync there would make a
    new loop per call, and the Redis layer keeps its connections per loop: each call would
    open fresh connections to Redis and drop them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._get()).result(SEND_TIMEOUT_SECS)

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # a forked child starts anew
                loop = asyncio.new_event_loop()
                name = "channel-layer-sender"
                threading.Thread(target=loop.run_forever, name=name, daemon=True).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop


_sender = _SenderLoop()


def _in_session_thread() -> bool:
    """Whether this thread runs sync code on behalf of a running event loop (a session's
    service in daphne, via sync_to_async): async_to_sync then hands the call back to that
    loop, where the layer already has its connections. (The attributes are asgiref's own,
    the ones async_to_sync reads.)"""
    local = SyncToAsync.threadlocal
    loop = getattr(local, "main_event_loop", None)
    return (
        loop is not None
        and getattr(local, "main_event_loop_pid", None) == os.getpid()
        and loop.is_running()
    )


def _run(make_coro) -> None:
    if _in_session_thread():
        async_to_sync(make_coro)()
    else:
        _sender.run(make_coro())


def send_to_worker_on_commit(worker_id: int, message: dict) -> None:
    """Sends `message` to the worker's session once the current transaction commits, so nothing
    is announced that then rolls back. The layer carries only wake-ups: if it is unreachable the
    state is already in PostgreSQL, so log and go on."""

    def send():
        async def group_send():
            await get_channel_layer().group_send(worker_group(worker_id), message)

        try:
            _run(group_send)
        except Exception:
            logger.warning(
                "could not send %s to worker %s", message.get("type"), worker_id, exc_info=True
            )

    transaction.on_commit(send)


def close_revoked_on_commit(worker_id: int) -> None:
    """Asks a revoked worker's live connection to close; the session also re-checks its token."""
    send_to_worker_on_commit(worker_id, {"type": "worker.revoked"})


def send_frames(frames: list[tuple[int, object]]) -> None:
    """Sends protocol messages now (outside any transaction); best effort, like every send."""
    layer = get_channel_layer()

    async def send_all():
        for worker_id, frame in frames:
            await layer.group_send(
                worker_group(worker_id), {"type": "worker.send", "frame": frame.frame()}
            )

    try:
        _run(send_all)
    except Exception:
        logger.warning("could not send %d frame(s)", len(frames), exc_info=True)
