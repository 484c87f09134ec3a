"""The planner's costs and solver: a member's scores are a row, cheapest first; a cluster's
seat costs a k x columns matrix; scipy's minimum-cost assignment over at most k cheapest seats
per member (cheapest) solves it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from clusters.planner import ScoreArrays, Snapshot
    from clusters.pool import Pool


class Row:
    """One job key's scores from the pool's workers, cheapest first; `complete` False when only
    the cheapest are here. The by-column form (find) is sorted when first asked for."""

    __slots__ = ("_by_column", "columns", "complete", "largest", "sizes")

    def __init__(self, columns: np.ndarray, sizes: np.ndarray, complete: bool = True):
        self.columns, self.sizes, self.complete = columns, sizes, complete
        self.largest = int(sizes[-1]) if sizes.size else 0
        self._by_column = None

    def find(self, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The size of each column where scored, and whether it is (a mask)."""
        if self._by_column is None:
            order = np.argsort(self.columns)
            self._by_column = (self.columns[order], self.sizes[order])
        by_column, sizes = self._by_column
        at = by_column.searchsorted(columns)
        at[at == by_column.size] = 0
        found = by_column[at] == columns if by_column.size else at < 0
        return sizes[at] if by_column.size else np.zeros(at.size, np.int64), found


NO_SCORES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


class Scores:
    """Score rows per job key, read from score_arrays one key at a time as the planner reaches
    it, so a snapshot may hand them over while still reading them."""

    def __init__(self, snapshot: Snapshot, pool: Pool):
        # Not `or {}`: a Mapping's truth is its length, and a CheapestScores still being read
        # would have to read every key before the first cluster is seated.
        arrays = snapshot.score_arrays
        self._arrays = {} if arrays is None else arrays
        self._truncated = snapshot.truncated
        self._full: dict[str, ScoreArrays] = {}  # rows complete() read
        self._load = snapshot.load_scores
        self._pool = pool
        self._rows: dict[str, Row] = {}

    def row(self, key: str) -> Row:
        row = self._rows.get(key)
        if row is None:
            if key in self._full:
                ids, sizes = self._full[key]
                complete = True
            else:
                ids, sizes = self._arrays.get(key, NO_SCORES)
                complete = key not in self._truncated
            row = self._rows[key] = _row(self._pool.column_of(ids), sizes, complete)
        return row

    def complete(self, keys: list[str], worker_ids: np.ndarray) -> None:
        """Replace the cheapest-only rows of these keys by their every score from these
        workers: complete as far as the planner looks from now on, if it looks no further."""
        if self._load is None:
            raise ValueError("truncated scores without load_scores")
        full = self._load(keys, worker_ids)
        for key in keys:
            self._full[key] = full.get(key, NO_SCORES)
            self._rows.pop(key, None)


def _row(columns: np.ndarray, sizes: np.ndarray, complete: bool = True) -> Row:
    """A row of these scores, sorted by size already (columns -1 for workers not in the pool)."""
    known = columns >= 0  # a score from a worker that holds no idle slot is no use here
    if not known.all():
        columns, sizes = columns[known], sizes[known]
    return Row(columns, sizes, complete)


def among_ties(seatable: np.ndarray, rows: list[Row], seats: list, columns: slice):
    """Each member, in order, on the first free seat of the group as cheap as its cheapest
    there (`seats`), or None when one finds none: the first fit, not a matching."""
    taken: set[int] = set()
    chosen = []
    for line, row, (_, size) in zip(seatable, rows, seats, strict=True):
        at = row.columns
        fits = line[at] & (row.sizes == size) & (at >= columns.start) & (at < columns.stop)
        column = next((c for c in at[fits].tolist() if c not in taken), None)
        if column is None:
            return None
        taken.add(column)
        chosen.append((column, size))
    return chosen


def costs(rows: list[Row], columns: np.ndarray, largest: int):
    """Each member's seat costs over the columns, its missing NAR size where scored, else a
    stand-in dearer than any scored seating (a non-seat is np.inf, no edge); and the sizes, -1
    where unscored."""
    k = len(rows)
    # Floats add integers exactly below 2**53, so sizes stay exact up to 2**50 / k**2 (64 TiB
    # for 4 members); larger ones are scaled down, which can blur their sums but not the rule
    # below.
    top = min(largest, 2**50 // k**2)
    scale = top / largest if largest > top else 1.0
    # Sizes are byte counts (>= 0). A stand-in of 2k times the largest makes one more
    # unscored seat dearer than any difference in real sizes, rounding and all.
    cost = np.full((k, columns.size), 2.0 * k * top + 1.0)
    sizes = np.full((k, columns.size), -1, dtype=np.int64)
    for line, sized, row in zip(cost, sizes, rows, strict=True):
        found_sizes, found = row.find(columns)
        sized[found] = found_sizes[found]
        line[found] = sized[found] * scale if scale != 1.0 else sized[found]
    return cost, sizes


def preferred(seatable: np.ndarray, rows: list[Row]) -> list[np.ndarray]:
    return [row.columns[line[row.columns]] for line, row in zip(seatable, rows, strict=True)]


def cheapest(seatable: np.ndarray, preferred: np.ndarray, columns: slice, k: int) -> np.ndarray:
    """A member's k cheapest seats among the columns: scored ones by size, then unscored ones.
    A minimum-cost matching of k members needs no other: were a member seated elsewhere, one of
    its k cheapest would be free, and no dearer. So the solver sees at most k * k columns.
    """
    scored = preferred[(preferred >= columns.start) & (preferred < columns.stop)][:k]
    if scored.size == k:
        return scored
    unscored = seatable[columns].copy()
    unscored[scored - columns.start] = False
    return np.concatenate([scored, columns.start + np.flatnonzero(unscored)[: k - scored.size]])


def solve(cost: np.ndarray) -> np.ndarray | None:
    """The column of each row in a minimum-cost full matching, or None if there is none."""
    # Imported here: scipy.optimize is slow to import, and every daphne imports this module
    # without ever solving.
    from scipy.optimize import linear_sum_assignment

    try:
        seated, columns = linear_sum_assignment(cost)
    except ValueError:  # "cost matrix is infeasible": no full matching avoids every np.inf
        return None
    # Trust but verify: every member seated, over real edges only.
    if seated.size != len(cost) or not np.isfinite(cost[seated, columns]).all():
        return None
    return columns
