"""Reaching one worker's live session from any process: each session joins its worker's group
on the Channels layer."""

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from itertools import batched

from asgiref.sync import SyncToAsync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

SEND_TIMEOUT_SECS = 30.0
# Group sends under way at once per batch of frames: well within the layer's Redis pool.
SENDS_AT_ONCE = 32
# Frames per batched group send: one Redis script call of a few hundred KiB at most.
SENDS_PER_BATCH = 256


def worker_group(worker_id: int) -> str:
    return f"worker-{worker_id}"


class _SenderLoop:
    """One event loop per process, on a thread of its own, for sends from outside any loop (a
    Celery pass, a command): async_to_sync would make a loop per call, each with fresh Redis
    connections."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0
        self._pending: set[concurrent.futures.Future] = set()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._get()).result(SEND_TIMEOUT_SECS)

    def submit(self, coro) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self._get())
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future) -> None:
        with self._lock:
            self._pending.discard(future)

    def drain(self, timeout: float = SEND_TIMEOUT_SECS) -> None:
        """Wait for the sends submitted so far (before an exit, or for a test)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout)

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # a forked child starts anew
                loop = asyncio.new_event_loop()
                name = "channel-layer-sender"
                threading.Thread(target=loop.run_forever, name=name, daemon=True).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop


_sender = _SenderLoop()


def drain_sends(timeout: float = SEND_TIMEOUT_SECS) -> None:
    """Wait for this process's sends that were not waited for."""
    _sender.drain(timeout)


def _session_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop this thread runs sync code for (a session's service, through asgiref's
    sync_to_async), if any: the layer already has its connections there."""
    local = SyncToAsync.threadlocal
    loop = getattr(local, "main_event_loop", None)
    if loop is not None and getattr(local, "main_event_loop_pid", None) == os.getpid():
        return loop if loop.is_running() else None
    return None


# A session's sends, per event loop, made in order by one task, so that the service that asked
# does not hold a database thread until the busy loop gets round to them.
_loop_sends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _send_on_loop(loop: asyncio.AbstractEventLoop, make_coro) -> None:
    def enqueue():
        queue = _loop_sends.get(loop)
        if queue is None:
            queue = _loop_sends[loop] = asyncio.Queue()
            loop.create_task(_send_in_order(queue))
        queue.put_nowait(make_coro)

    loop.call_soon_threadsafe(enqueue)


async def _send_in_order(queue: asyncio.Queue) -> None:
    while True:
        make_coro = await queue.get()
        try:
            await make_coro()
        except Exception:  # the coroutines log their own failures; nothing may end this task
            logger.warning("a send failed", exc_info=True)


def _run(make_coro, wait: bool = True) -> None:
    """Run a send: from a session's thread, queued on its loop (not awaited); elsewhere, on
    the process's sender loop, waited for unless `wait` is false."""
    loop = _session_loop()
    if loop is not None:
        _send_on_loop(loop, make_coro)
    elif wait:
        _sender.run(make_coro())
    else:
        _sender.submit(make_coro())


def send_to_worker_on_commit(worker_id: int, message: dict) -> None:
    """Sends `message` to the worker's session once the transaction commits. The layer carries
    only wake-ups whose state is in PostgreSQL: if it is unreachable, log and go on."""

    async def group_send():
        try:
            await get_channel_layer().group_send(worker_group(worker_id), message)
        except Exception:
            logger.warning(
                "could not send %s to worker %s", message.get("type"), worker_id, exc_info=True
            )

    def send():
        try:
            _run(group_send)
        except Exception:  # the sender loop timed out
            logger.warning(
                "could not send %s to worker %s", message.get("type"), worker_id, exc_info=True
            )

    transaction.on_commit(send)


def close_revoked_on_commit(worker_id: int) -> None:
    """Asks a revoked worker's live connection to close; the session also re-checks its token."""
    send_to_worker_on_commit(worker_id, {"type": "worker.revoked"})


def send_frames(
    frames: list[tuple[int, object]], event: str = "worker.send", wait: bool = True
) -> None:
    """Sends protocol messages now, best effort; `event` names the session's handler, and without
    `wait` the caller goes on while they are sent."""
    layer = get_channel_layer()
    # A message sent to several workers (a StartCluster to every member) is rendered once.
    texts = {id(message): message.frame() for _, message in frames}
    per_worker: dict[int, list[str]] = {}
    for worker_id, message in frames:
        per_worker.setdefault(worker_id, []).append(texts[id(message)])

    async def send_one(worker_id: int, texts: list[str], gate: asyncio.Semaphore):
        async with gate:
            for text in texts:  # one worker's frames in order
                await layer.group_send(worker_group(worker_id), {"type": event, "frame": text})

    async def send_all():
        if hasattr(layer, "group_send_many"):  # gradient.channel_layer's, on Redis
            sends = [
                (worker_group(w), {"type": event, "frame": text})
                for w, texts in per_worker.items()
                for text in texts
            ]
            try:
                for chunk in batched(sends, SENDS_PER_BATCH):
                    if dropped := await layer.group_send_many(list(chunk)):
                        logger.warning("%d frame(s) dropped: channel full", dropped)
            except Exception:
                logger.warning("could not send %d frame(s)", len(frames), exc_info=True)
            return
        # Another layer (the in-memory one of unit tests): the workers' sends side by side.
        gate = asyncio.Semaphore(SENDS_AT_ONCE)
        sends = [send_one(w, texts, gate) for w, texts in per_worker.items()]
        failed = [r for r in await asyncio.gather(*sends, return_exceptions=True) if r]
        if failed:
            logger.warning("could not send %d frame(s)", len(frames), exc_info=failed[0])

    try:
        _run(send_all, wait)
    except Exception:  # the sender loop timed out
        logger.warning("could not send %d frame(s)", len(frames), exc_info=True)
