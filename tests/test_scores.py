"""Unpacking the scores as PostgreSQL sends them: (worker id, size) pairs as big-endian int64."""

import struct

from clusters.scores import _unpack_all


def packed(*pairs):
    return b"".join(struct.pack(">qq", worker, size) for worker, size in pairs)


def plain(lists):
    return [(ids.tolist(), sizes.tolist()) for ids, sizes in lists]


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
