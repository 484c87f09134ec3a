"""The planner's idle workers as columns: who may seat whom, zones, who is taken. Eligibility
is a boolean mask over the columns, cached per member profile, so that a cluster never costs a
Python loop over pairs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from clusters.planner import Member, Placement, Worker

# The slot kinds and the capability each needs; a fetch-only worker (can_eval False) never
# seats an eval member.
KINDS = {"eval": "can_eval", "build": "can_build"}


class Pool:
    """The idle workers as columns, sorted by zone, so that a zone is a slice."""

    def __init__(self, workers: tuple[Worker, ...]):
        # Named zones sorted, then the zoneless workers as a zone of their own: also the
        # tie-break order between zones of equal cost.
        zones: list[str | None] = [*sorted({w.zone for w in workers} - {None}), None]
        rank = {zone: i for i, zone in enumerate(zones)}
        self.workers = tuple(sorted(workers, key=lambda w: rank[w.zone]))
        self.size = len(workers)
        self._zones: list[tuple[str | None, slice]] = []
        start, count = 0, Counter(w.zone for w in workers)
        for zone in zones:
            self._zones.append((zone, slice(start, start + count[zone])))
            start += count[zone]
        # Each column's zone, and the zones that have workers at all.
        self._zone_of = np.repeat(np.arange(len(zones)), [count[z] for z in zones])
        self._peopled = np.array([count[z] > 0 for z in zones])
        # Each column's index among the groups of a same_zone cluster (the peopled zones).
        group_of_zone = np.cumsum(self._peopled) - 1
        self._group_of_column = group_of_zone[self._zone_of]
        self._group_count = int(self._peopled.sum())
        self._group_range = np.arange(self._group_count)[:, None]
        ids = np.array([w.id for w in self.workers], dtype=np.int64)
        self.ids = ids  # each column's worker id
        self._by_id = np.argsort(ids)
        self._sorted_ids = ids[self._by_id]
        # Worker ids are nearly dense: a lookup table, its last entry -1 for ids out of range.
        self._lookup = None
        if self.size and ids.min() >= 0 and ids.max() < 16 * self.size + 4096:
            self._lookup = np.full(ids.max() + 2, -1, dtype=np.int64)
            self._lookup[ids] = np.arange(self.size)
        self._column = {w.id: i for i, w in enumerate(self.workers)}
        # A worker seated for one cluster is not offered to the next.
        self.available = np.ones(self.size, dtype=bool)
        self.free = self.size  # how many are still available
        # Inverted indexes, one pass each, so a new profile costs a few mask operations.
        self._by_kind = {kind: self._where(w for w in workers if _takes(w, kind)) for kind in KINDS}
        # A name is one worker's: its column, not a mask of the whole pool per worker.
        self._by_name = {w.name: column for column, w in enumerate(self.workers)}
        self._by_arch = _inverted(self.workers, lambda w: w.architectures)
        self._by_feature = _inverted(self.workers, lambda w: w.features)
        self._by_project = _inverted(self.workers, lambda w: w.projects or ())
        self._every_project = self._where(w for w in workers if w.projects is None)
        self._profiles: dict[tuple, np.ndarray] = {}

    def groups(self, same_zone: bool) -> list[tuple[str | None, slice]]:
        """The column ranges a cluster may sit in: one per zone under same_zone, else all."""
        if same_zone:
            return [
                (zone, columns) for zone, columns in self._zones if columns.stop > columns.start
            ]
        return [(None, slice(0, self.size))]

    def short_of(self, seats: np.ndarray, same_zone: bool, k: int) -> bool:
        """Whether these seats (columns) number fewer than k in some range of groups()."""
        if not same_zone:
            return seats.size < k
        counts = np.bincount(self._zone_of[seats], minlength=self._peopled.size)
        return bool((counts[self._peopled] < k).any())

    def first_per_group(self, columns: np.ndarray, seat: np.ndarray, same_zone: bool) -> list:
        """For columns in a member's cheapest-first order and whether each is a seat, the
        position of the first seat in each of groups()'s ranges, -1 where there is none."""
        if not same_zone:
            at = int(seat.argmax()) if seat.size else 0
            return [at if seat.size and seat[at] else -1]
        if not seat.size:
            return [-1] * self._group_count
        # Each seat's group, the non-seats a group past the last; per group, the first position
        # that holds it (argmax finds the first True; for a group with none it gives 0).
        groups = np.where(seat, self._group_of_column[columns], self._group_count)
        hit = groups == self._group_range
        return np.where(hit.any(axis=1), hit.argmax(axis=1), -1).tolist()

    def eligible(self, member: Member) -> np.ndarray:
        """Columns that are a seat for the member (seat_reason None), whether seated or not."""
        profile = (member.kind, member.pin, member.architecture, member.features, member.project_id)
        mask = self._profiles.get(profile)
        if mask is None:
            mask = self._profiles[profile] = self._profile_mask(member)
        return mask

    def take(self, placement: Placement) -> None:
        for seat in placement.seats:
            self.available[self._column[seat.worker.id]] = False
        self.free -= len(placement.seats)  # a placement's seats are distinct workers

    def column_of(self, worker_ids: np.ndarray) -> np.ndarray:
        """The column of each worker id, -1 for a worker not in the pool."""
        if self._lookup is not None:
            last = self._lookup.size - 1  # -1, for every id out of range
            inside = (worker_ids >= 0) & (worker_ids < last)
            return self._lookup[np.where(inside, worker_ids, last)]
        if self.size == 0:
            return np.full(worker_ids.shape, -1, dtype=np.int64)
        at = np.searchsorted(self._sorted_ids, worker_ids).clip(max=self.size - 1)
        return np.where(self._sorted_ids[at] == worker_ids, self._by_id[at], -1)

    def _profile_mask(self, member: Member) -> np.ndarray:
        mask = self._by_kind.get(member.kind, self._where(())).copy()
        if member.pin is not None:
            pinned = np.zeros(self.size, dtype=bool)
            if member.pin in self._by_name:
                pinned[self._by_name[member.pin]] = True
            mask &= pinned
        mask &= self._by_arch.get(member.architecture, False)
        for feature in member.features:
            mask &= self._by_feature.get(feature, False)
        mask &= self._every_project | self._by_project.get(member.project_id, False)
        return mask

    def _where(self, workers: Iterable[Worker]) -> np.ndarray:
        mask = np.zeros(self.size, dtype=bool)
        mask[[self._column[w.id] for w in workers]] = True
        return mask


def _takes(worker: Worker, kind: str) -> bool:
    """An idle slot of the kind and the capability to run it, and not quarantined."""
    return kind in worker.idle_kinds and not worker.quarantined and getattr(worker, KINDS[kind])


def _inverted(workers: tuple[Worker, ...], values) -> dict:
    """value -> mask of the workers having it."""
    columns: dict = {}
    for column, worker in enumerate(workers):
        for value in values(worker):
            columns.setdefault(value, []).append(column)
    masks = {}
    for value, where in columns.items():
        masks[value] = np.zeros(len(workers), dtype=bool)
        masks[value][where] = True
    return masks
