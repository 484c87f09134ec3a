"""Session starts of one event loop: how many run at once, the other sessions' frames held
back while many are pending (a reconnect storm), and the session a start replaces."""

import asyncio
import contextlib
import logging
import weakref

from channels.exceptions import ChannelFull

from gradient.wire.groups import worker_group

log = logging.getLogger(__name__)

# Session starts under way at once, per event loop: past this many, a start waits here rather
# than for the channel layer's Redis connections, which time out.
SESSION_STARTS = 32
# Starts first: while many sessions are between their handshake and their InitAck, the other
# sessions' frames wait, each up to STARTS_FIRST_SECS, so fewer handshakes time out.
STARTS_FIRST_SECS = 5.0
STORM_STARTS = 8


class Starts:
    """The session starts of one event loop: the semaphore above, and how many are pending."""

    def __init__(self):
        self.gate = asyncio.Semaphore(SESSION_STARTS)
        self.pending = 0
        self.calm = asyncio.Event()
        self.calm.set()

    def begin(self):
        self.pending += 1
        if self.pending > STORM_STARTS:
            self.calm.clear()

    def end(self):
        self.pending -= 1
        if self.pending <= STORM_STARTS:
            self.calm.set()

    async def wait_for_calm(self):
        if not self.calm.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.calm.wait(), STARTS_FIRST_SECS)


class SessionStart:
    """One session's start, pending from its handshake to its InitAck, for STARTS_FIRST_SECS at
    most: a worker that never sends its capabilities must not hold the others back longer."""

    def __init__(self):
        self.under_way = False
        self._starts: Starts | None = None

    def begin(self):
        self.under_way = True
        self._starts = session_starts()
        self._starts.begin()
        asyncio.get_running_loop().call_later(STARTS_FIRST_SECS, self.end)

    def end(self):
        if self.under_way:
            self.under_way = False
            self._starts.end()

    @contextlib.contextmanager
    def ended_if_failed(self):
        try:
            yield
        except BaseException:
            self.end()
            raise

    async def wait_for_calm(self):
        """A started session's work waits while a storm of other starts is pending; its own
        start does not."""
        if not self.under_way:
            await session_starts().wait_for_calm()


_starts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def session_starts() -> Starts:
    loop = asyncio.get_running_loop()
    if loop not in _starts:
        _starts[loop] = Starts()
    return _starts[loop]


async def leave_replaced(layer, worker_id: int, worker_name: str, previous: str):
    """The replaced session (channel `previous`) leaves the worker's group and is told to close:
    one whose daphne was killed never runs its disconnect, and its dead channel would fill up.
    Best effort: a live old session closes at its next liveness check anyway."""
    await session_starts().wait_for_calm()
    try:
        await layer.group_discard(worker_group(worker_id), previous)
        await layer.send(previous, {"type": "session.replaced"})
    except ChannelFull:
        pass  # nobody reads that channel: its session died with its daphne
    except Exception:
        log.warning("could not tell the replaced session of worker %s", worker_name, exc_info=True)
