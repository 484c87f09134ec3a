"""The members' scores of every session of a daphne process, written together.

Written one JobScores frame at a time, each answer held a frame thread for a statement and a
commit, and a busy fleet's answers queued behind each other for seconds: past the score wait,
so the pass placed its clusters without them (docs/design.md). A session hands its answer
here instead and awaits it: one statement writes every answer that came while the last one
ran, on one frame thread. When that statement fails, each of its answers is written alone,
so that only a session whose own answer fails ends, as it did when each wrote its own.
"""

import asyncio
import weakref

from sessions.threads import db
from workers import offers


class ScoreWrites:
    """The answers of one event loop's sessions waiting for the next write."""

    def __init__(self):
        self._waiting: list[tuple[int, list, asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def write(self, worker_id: int, scores: list) -> None:
        """Store these scores of this worker; returns once they are committed."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((worker_id, scores, done))
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="score-writes")
        await done

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    await db(offers.record_answers)([(w, scores) for w, scores, _ in batch])
                except Exception:
                    for answer in batch:
                        await self._write_alone(*answer)
                else:
                    for *_, done in batch:
                        _settle(done)
        finally:
            self._task = None

    async def _write_alone(self, worker_id: int, scores: list, done: asyncio.Future) -> None:
        try:
            await db(offers.record_answers)([(worker_id, scores)])
        except Exception as exc:
            _settle(done, exc)
        else:
            _settle(done)


def _settle(done: asyncio.Future, exc: Exception | None = None) -> None:
    if done.done():
        return  # its session went (the awaiting handler was cancelled)
    if exc is None:
        done.set_result(None)
    else:
        done.set_exception(exc)


_per_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def score_writes() -> ScoreWrites:
    """This event loop's writer (daphne has one loop per process; tests make one per test)."""
    loop = asyncio.get_running_loop()
    writes = _per_loop.get(loop)
    if writes is None:
        writes = _per_loop[loop] = ScoreWrites()
    return writes
