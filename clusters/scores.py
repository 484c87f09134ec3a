"""The member jobs' scores as a dispatch pass reads them for the planner.

Up front, each member job's cheapest scores only (an index-only read), in chunks, on a thread
of their own while the planner seats the clusters whose scores have arrived. A job's other
scores are read only when too few of its cheapest are left to decide (Snapshot.load_scores).
"""

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from itertools import pairwise

import numpy as np
from django.db import close_old_connections, connection

from clusters import statements
from gradient.postgresql.arrays import int_array, text_array

# How many of each job's cheapest scores a pass reads up front. A member needs k free seats
# of its own per zone among them; fewer, and the planner reads that job's other scores.
CHEAPEST = 128


def _unpack_all(packed: list[bytes]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each packed list as (worker ids, sizes) sorted by (size, worker id), as the planner needs
    them to tell that a job's cheapest are a prefix of its full list. numpy is called a few
    times for all the lists rather than for each: a chunk of scores is hundreds of short ones."""
    if not packed:
        return []
    pairs = np.frombuffer(b"".join(packed), dtype=">i8").reshape(-1, 2)
    ids, sizes = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    ends = np.cumsum([len(p) // 16 for p in packed])
    step = np.diff(sizes)
    ordered = (step > 0) | ((step == 0) & (np.diff(ids) > 0))
    ordered[ends[:-1] - 1] = True  # from one list to the next
    lists = list(zip(np.split(ids, ends[:-1]), np.split(sizes, ends[:-1]), strict=True))
    if not ordered.all():  # PostgreSQL aggregated some out of the index's order
        for i, (list_ids, list_sizes) in enumerate(lists):
            order = np.lexsort((list_ids, list_sizes))
            lists[i] = (list_ids[order], list_sizes[order])
    return lists


def _read_lists(sql: str, params: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(job key, packed scores) rows of a statement, unpacked per key."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    return dict(zip([job_id for job_id, _ in rows], _unpack_all([p for _, p in rows]), strict=True))


# Up to this many workers, their scores are read pair by pair; past it, the jobs' full lists,
# which cost less once the pairs are many (docs/design.md).
PROBED_WORKERS = CHEAPEST


def all_scores(keys: list[str], worker_ids=None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every answered score of these jobs from these workers (from any, without them; with
    many, others come along), sorted like their cheapest: by (size, worker id)."""
    if worker_ids is not None and len(worker_ids) <= PROBED_WORKERS:
        params = {"keys": text_array(keys), "workers": int_array(worker_ids)}
        return _read_lists(statements.SCORES_ON_SQL, params)
    return _read_lists(statements.ALL_SCORES_SQL, {"keys": text_array(keys)})


def pin_scores(pins: Mapping[str, int | None]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each pinned job's score on its pin's worker, where it has one."""
    asked = {key: worker for key, worker in pins.items() if worker is not None}
    if not asked:
        return {}
    params = {"keys": text_array(list(asked)), "workers": int_array(list(asked.values()))}
    return _read_lists(statements.PIN_SCORES_SQL, params)


@contextmanager
def own_connection():
    """Work on a pass's thread with its own connection, dropped before and after if it broke or
    outlived CONN_MAX_AGE, as Django does around a request."""
    close_old_connections()
    try:
        yield
    finally:
        close_old_connections()


# Keys per read of CHEAPEST_SCORES_SQL, the first read smaller: a pass that seats a few
# clusters only reads little more than theirs.
FIRST_CHUNK = 32
SCORE_CHUNK = 256
# Chunks read ahead of the last one the planner waited for, so that a busy fleet's pass does
# not read the scores of clusters it cannot seat anyway.
READ_AHEAD = 2


def _chunks(count: int) -> list[tuple[int, int]]:
    bounds = [0, *range(min(FIRST_CHUNK, count), count, SCORE_CHUNK), count]
    return [(a, b) for a, b in pairwise(bounds) if b > a]


# Reading is PostgreSQL's work and planning Python's: a thread of its own lets them overlap.
_score_reader = ThreadPoolExecutor(1, thread_name_prefix="scores")


class CheapestScores(Mapping):
    """Each member job's cheapest scores, job key -> (worker ids, sizes), read in chunks in the
    order given; a lookup, and `truncated`, wait for its key's chunk. The keys in `pins` (job ->
    its pin's worker id, or None) are read for that worker's score alone: a pinned member has one
    seat, seldom among the cheapest."""

    def __init__(self, keys: list[str], pins: Mapping[str, int | None] | None = None):
        self._keys = keys
        self._pins = pins or {}
        self._bounds = _chunks(len(keys))
        self._chunk_of = {
            key: chunk
            for chunk, (start, stop) in enumerate(self._bounds)
            for key in keys[start:stop]
        }
        self._read = [threading.Event() for _ in self._bounds]
        self._asked = -1  # the last chunk the planner waited for
        self._progress = threading.Condition()
        self._whole = [False] * len(self._read)  # chunks read to the end
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._truncated: set[str] = set()
        self._error: BaseException | None = None
        self._stop = False
        self._future = None
        self.truncated = _Truncated(self)

    def read(self, lazy: bool = False) -> None:
        """Read every chunk in order (on the calling thread); `lazy`, at most READ_AHEAD
        chunks ahead of the planner (a reader of its own, while the planner waits)."""
        try:
            with connection.cursor() as cursor:
                for chunk, ready in enumerate(self._read):
                    if lazy:
                        with self._progress:
                            self._progress.wait_for(
                                lambda c=chunk: self._stop or c <= self._asked + READ_AHEAD
                            )
                    if self._stop:
                        raise RuntimeError("the pass stopped reading scores")
                    start, stop = self._bounds[chunk]
                    keys = self._keys[start:stop]
                    pinned = [key for key in keys if key in self._pins]
                    if pinned:
                        keys = [key for key in keys if key not in self._pins]
                        self._arrays.update(pin_scores({k: self._pins[k] for k in pinned}))
                    rows = []
                    if keys:  # (a chunk may hold pinned members' keys only)
                        cursor.execute(
                            statements.CHEAPEST_SCORES_SQL,
                            {"keys": text_array(keys), "limit": CHEAPEST},
                        )
                        rows = cursor.fetchall()
                    lists = _unpack_all([packed for _, packed, _ in rows])
                    for (job_id, _, count), (ids, sizes) in zip(rows, lists, strict=True):
                        if count > CHEAPEST:
                            ids, sizes = ids[:CHEAPEST], sizes[:CHEAPEST]
                            self._truncated.add(job_id)
                        self._arrays[job_id] = (ids, sizes)
                    self._whole[chunk] = True
                    ready.set()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            for ready in self._read:
                ready.set()  # a reader that failed leaves nobody waiting: they see the error

    def start(self) -> "CheapestScores":
        """Read on the scores' thread (and its connection) from now on."""

        def on_thread():
            with own_connection():
                self.read(lazy=True)

        self._future = _score_reader.submit(on_thread)
        return self

    def finish(self) -> None:
        """Stop reading (if still at it) and wait for the reader: a pass ends with its reads."""
        with self._progress:
            self._stop = True
            self._progress.notify_all()
        if self._future is not None:
            wait([self._future])

    def is_truncated(self, key: str) -> bool:
        self.wait_for(key)
        return key in self._truncated

    def wait_for(self, key: str) -> None:
        chunk = self._chunk_of.get(key)
        if chunk is not None:
            if chunk > self._asked:
                with self._progress:
                    self._asked = max(self._asked, chunk)
                    self._progress.notify_all()
            self._read[chunk].wait()
            if not self._whole[chunk]:
                raise RuntimeError("reading the cheapest scores failed") from self._error

    def __getitem__(self, key: str):
        self.wait_for(key)
        return self._arrays[key]

    def __iter__(self):
        for key in self._keys:
            self.wait_for(key)
        return iter(self._arrays)

    def __len__(self) -> int:
        for key in self._keys:
            self.wait_for(key)
        return len(self._arrays)


class _Truncated:
    def __init__(self, scores: CheapestScores):
        self._scores = scores

    def __contains__(self, key) -> bool:
        return self._scores.is_truncated(key)
