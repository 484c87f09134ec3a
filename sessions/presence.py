"""A session's presence as its worker's: attached in PostgreSQL, in the worker's group so that
the passes reach it, and kept fresh by touches (sessions.liveness disconnects the silent)."""

import asyncio
import logging
import time

from gradient.logs import ids
from gradient.wire.groups import worker_group
from gradient.wire.protocol import RunningJob, WorkerCapabilities
from sessions import connection
from sessions.frame_queue import Touch
from sessions.starts import leave_replaced, session_starts
from sessions.threads import db, handshake_db
from workers.liveness import touch_every
from workers.models import Worker

log = logging.getLogger(__name__)

# A session joins its group again this often (a Redis restart empties the groups), and writes
# its liveness every workers.liveness.touch_every() seconds, at the touch that follows.
TOUCH_EVERY_SECS = 5.0


class Presence:
    """A session's hold on its worker; a touch that finds the token revoked or a newer session
    attached ends it. On the handshake's threads until the InitAck."""

    def __init__(self, layer, worker_id: int, worker_name: str, channel: str):
        self.layer, self.channel = layer, channel
        self.worker_id, self.worker_name = worker_id, worker_name
        self.earlier_open = False  # attach() found what an earlier session left open
        self.touched = self.seen = 0.0  # set once attached: attach() is as good as a touch
        self.every = touch_every()
        self.replacing: asyncio.Future | None = None  # telling the session this one replaces

    async def attach(self) -> None:
        """In the group and attached, a few starts at a time (sessions.starts)."""
        async with session_starts().gate:
            await self.join_group()
            previous, self.earlier_open = await handshake_db(connection.attach)(
                self.worker_id, self.channel
            )
        self.touched = self.seen = time.monotonic()
        if previous and previous != self.channel:
            # Off the start's path: after a restart every session replaces a dead one.
            self.replacing = asyncio.ensure_future(
                leave_replaced(self.layer, self.worker_id, self.worker_name, previous)
            )
        log.info("worker %s connected", self.worker_name, extra=ids(worker=self.worker_id))

    async def record(self, caps: WorkerCapabilities) -> tuple[Worker, list[RunningJob]]:
        """The worker's capabilities recorded: its row, and what it says it runs from an
        earlier session that was closed meanwhile (it must not go on running)."""
        closed = []
        if self.earlier_open or caps.running:
            self.earlier_open = False
            closed = await handshake_db(connection.release_earlier)(self.worker_id, caps.running)
        return await handshake_db(connection.record_capabilities)(self.worker_id, caps), closed

    async def detach(self, code: int) -> None:
        await self.layer.group_discard(worker_group(self.worker_id), self.channel)
        if await db(connection.detach)(self.worker_id, self.channel):
            name, worker = self.worker_name, ids(worker=self.worker_id)
            log.info("worker %s disconnected (%s)", name, code, extra=worker)

    def due(self, now: float | None = None) -> Touch | None:
        """The touch a frame arriving now brings, if one is due: queued with the bulk frames,
        since those after it ask for work, which a session that lost must not get."""
        now = time.monotonic() if now is None else now
        if now - self.touched < TOUCH_EVERY_SECS:
            return None
        self.touched = now
        write = now - self.seen >= self.every
        if write:
            self.seen = now
        return Touch(liveness=write)

    async def touch(self, touch: Touch) -> bool:
        """The group joined again and, when due, liveness written; whether still the live one."""
        if touch.liveness and not await db(connection.touch)(self.worker_id, self.channel):
            return False
        await self.join_group()
        return True

    async def join_group(self) -> None:
        """At the start and at every touch: a Redis restart empties every group, and channels-redis
        expires members. A failure is retried at the next touch; Redis carries only wake-ups."""
        try:
            await self.layer.group_add(worker_group(self.worker_id), self.channel)
        except Exception:
            log.warning("worker %s could not join its group", self.worker_name, exc_info=True)
