"""Unpacking the scores as PostgreSQL sends them: (worker id, size) pairs as big-endian int64."""

import struct
import threading
import uuid

import numpy as np
import pytest

from clusters.scores import FIRST_CHUNK, READ_AHEAD, SCORE_CHUNK, CheapestScores, _unpack_all


def packed(*pairs):
    return b"".join(struct.pack(">qq", worker, size) for worker, size in pairs)


def plain(lists):
    return [(ids.tolist(), sizes.tolist()) for ids, sizes in lists]


class Parking(threading.Condition):
    """The reader's condition, telling when the reader waits on it (Condition.wait_for calls
    wait): parked, it reads nothing more until the planner asks, so what it has read by then
    is all it reads ahead."""

    def __init__(self):
        super().__init__()
        self.parked = threading.Event()

    def wait(self, timeout=None):
        self.parked.set()
        try:
            return super().wait(timeout)
        finally:
            self.parked.clear()


def watched(scores: CheapestScores) -> Parking:
    scores._progress = parking = Parking()
    return parking


def read(scores: CheapestScores) -> list[bool]:
    return [chunk.is_set() for chunk in scores._read]


def test_lists_in_the_index_order_come_back_as_they_are_each_its_own():
    lists = [packed((7, 1), (3, 2), (9, 2)), packed((1, 0)), packed((2, 5), (1, 6))]
    # The last pair of one list is dearer than the first of the next: no reason to reorder.
    assert plain(_unpack_all(lists)) == [([7, 3, 9], [1, 2, 2]), ([1], [0]), ([2, 1], [5, 6])]


def test_a_list_out_of_order_is_sorted_by_size_then_worker():
    lists = [packed((1, 4), (2, 4)), packed((9, 3), (4, 1), (5, 1))]
    assert plain(_unpack_all(lists)) == [([1, 2], [4, 4]), ([4, 5, 9], [1, 1, 3])]


def test_sizes_beyond_32_bits_and_no_lists_at_all():
    assert plain(_unpack_all([packed((2**40, 2**62))])) == [([2**40], [2**62])]
    assert _unpack_all([]) == []


@pytest.mark.django_db(transaction=True)
def test_the_reader_keeps_a_few_chunks_ahead_of_the_planner_and_no_further():
    from tests.factories import WorkerFactory, answered_scores

    worker = WorkerFactory()
    keys = [f"eval:{uuid.uuid4()}" for _ in range(FIRST_CHUNK + 5 * SCORE_CHUNK)]
    answered_scores((worker, key, size) for size, key in enumerate(keys))
    scores = CheapestScores(keys)
    parking = watched(scores)
    scores.start()
    try:
        assert len(scores._read) == 6
        assert parking.parked.wait(10)
        assert read(scores) == [True] * READ_AHEAD + [False] * 4  # nobody asked yet
        # The planner reaches the third chunk: the reader goes on up to two beyond it.
        key = keys[FIRST_CHUNK + SCORE_CHUNK + 1]
        assert scores[key][1].tolist() == [keys.index(key)]
        assert scores._read[2 + READ_AHEAD].wait(10)
        # Woken past its first stop, so parked again after reading the third chunk's two.
        assert parking.parked.wait(10)
        assert read(scores) == [True] * 5 + [False]
        assert scores[keys[-1]][1].tolist() == [len(keys) - 1]  # and the rest on demand
    finally:
        scores.finish()


@pytest.mark.django_db(transaction=True)
def test_a_pinned_job_is_read_for_its_pins_score_alone_the_others_cheapest_first():
    from clusters.scores import CHEAPEST
    from tests.factories import WorkerFactory, answered_scores

    workers = WorkerFactory.create_batch(CHEAPEST + 3)
    pinned, other = f"eval:{uuid.uuid4()}", f"build:{uuid.uuid4()}"
    busy_pin, unscored = f"eval:{uuid.uuid4()}", f"build:{uuid.uuid4()}"
    # The last workers are the cheapest; the pin, the first, is the dearest.
    answered_scores(
        (w, key, 1000 - i) for key in (pinned, other, busy_pin) for i, w in enumerate(workers)
    )
    by_size = [w.pk for w in reversed(workers)]
    pin = workers[0].pk

    pins = {pinned: pin, busy_pin: None, unscored: pin}  # busy_pin's worker has no idle slot
    scores = CheapestScores([other, pinned, busy_pin, unscored], pins=pins)
    scores.read()

    assert scores[pinned][0].tolist() == [pin] and scores[pinned][1].tolist() == [1000]
    assert pinned not in scores.truncated  # complete: its pin is its only seat
    assert busy_pin not in scores and unscored not in scores
    assert scores[other][0].tolist() == by_size[:CHEAPEST]
    assert other in scores.truncated


@pytest.mark.django_db(transaction=True)
def test_the_planner_seats_the_first_cluster_before_the_last_chunk_is_read():
    from clusters import planner
    from clusters.scores import all_scores
    from tests import planning
    from tests.factories import WorkerFactory, answered_scores

    worker = WorkerFactory()
    clusters = [
        planning.cluster(planning.member(uuid.uuid4()), id=i)
        for i in range(FIRST_CHUNK + 5 * SCORE_CHUNK)
    ]
    keys = [c.members[0].key for c in clusters]
    answered_scores((worker, key, 7) for key in keys)
    scores = CheapestScores(keys)
    parking = watched(scores)
    scores.start()
    try:
        snap = planner.Snapshot(
            clusters=tuple(clusters),
            workers=(planning.worker(worker.pk, name=worker.name),),
            score_arrays=scores,
            truncated=scores.truncated,
            load_scores=all_scores,
        )
        first = next(planner.placements(snap))
        assert (first.cluster_id, first.seats[0].missing_nar_size) == (0, 7)
        # Only the chunks read ahead of the first: the rest waits for the planner to ask. The
        # reader read past its first stop once asked, then parked again.
        assert scores._read[READ_AHEAD].wait(10)
        assert parking.parked.wait(10)
        assert read(scores) == [True] * (1 + READ_AHEAD) + [False] * 3
    finally:
        scores.finish()


@pytest.mark.django_db(transaction=True)
def test_scores_from_a_few_workers_are_theirs_alone_and_from_many_every_one():
    from clusters.scores import PROBED_WORKERS, all_scores
    from tests.factories import WorkerFactory, answered_scores

    workers = WorkerFactory.create_batch(PROBED_WORKERS + 2)
    key, other = f"build:{uuid.uuid4()}", f"build:{uuid.uuid4()}"
    answered_scores((w, k, 50 - i % 7) for k in (key, other) for i, w in enumerate(workers))
    ids = np.array([workers[3].pk, workers[10].pk, workers[9].pk, 10**9])  # the last: no scores

    read = all_scores([key], ids)

    assert list(read) == [key]
    # Sorted by size, then worker id: 50 - 3, 50 - 3 (10 % 7), 50 - 2 (9 % 7).
    assert read[key][0].tolist() == [workers[3].pk, workers[10].pk, workers[9].pk]
    assert read[key][1].tolist() == [47, 47, 48]
    # Past PROBED_WORKERS, the full list: the workers not asked about come along.
    many = np.array([w.pk for w in workers[:-1]])
    assert sorted(all_scores([key], many)[key][0].tolist()) == sorted(w.pk for w in workers)
