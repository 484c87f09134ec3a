"""A session's frames, handled in arrival order by a task of their own.

A consumer handles one event at a time: while it awaits a frame's database work, the passes'
frames to its worker wait too. So a session hands its frames to FrameQueues (acceptances,
reports, the bulk) and goes back to its events. A queue may wait for the earlier frames of the
one before it, but never holds them back (sessions/lanes.py).
"""

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

log = logging.getLogger(__name__)


class FrameQueue:
    def __init__(self, name: str, handle: Callable[[object], Awaitable[None]], on_error):
        self.name = name
        self._handle = handle
        self._on_error = on_error  # called with the frame whose handling raised
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False

    def put(self, frame, after: asyncio.Future | None = None) -> asyncio.Future:
        """Queue a frame, handled once `after` (if given) is done; a future done once it is."""
        done = asyncio.get_running_loop().create_future()
        if self._closing:
            done.set_result(None)
            return done
        self._items.append((frame, after, done))
        self._ready.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"frames-{self.name}")
        return done

    def waiting(self, match: Callable[[object], bool]) -> int:
        """How many frames not yet handled match."""
        return sum(1 for frame, _, _ in self._items if match(frame))

    async def _run(self) -> None:
        while True:
            while not self._items:
                if self._closing:
                    return
                self._ready.clear()
                await self._ready.wait()
            frame, after, done = self._items.popleft()
            try:
                if after is not None:
                    await after
                if not self._closing:
                    await self._handle(frame)
            except Exception:
                # As if handled inline: the session ends, and the worker reconnects.
                log.exception("%s: %s failed", self.name, type(frame).__name__)
                self._drop()
                await self._on_error(frame)
                return
            finally:
                if not done.done():
                    done.set_result(None)

    def _drop(self) -> None:
        self._closing = True
        for _, _, done in self._items:
            done.set_result(None)
        self._items.clear()

    async def stop(self) -> None:
        """Drop the frames still waiting and wait for the one under way, if any."""
        self._drop()
        if self._task is not None:
            self._ready.set()  # an idle task wakes, sees it is closing, and ends
            await self._task


# The frames a session queues for itself, with its bulk frames (not protocol messages).


class Touch(NamedTuple):
    """A session's group join and, when due, liveness check, queued with its bulk frames."""

    liveness: bool


class OfferAll(NamedTuple):
    """A session's first offer, queued with its bulk frames (not a protocol message)."""

    worker: object  # the Worker row just written by record_capabilities


class ScoresLate(NamedTuple):
    """GRADIENT_SCORE_WAIT_MS passed since an offer that requests wait on (not a message)."""

    offer: int  # which offer (Requests.offers_made at the time)
