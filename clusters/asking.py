"""Asking the idle seats for their scores (protocol.md, the head of the queue).

A cluster that becomes able to start is offered at once to the idle workers that could seat
its members, and the dispatch pass places it on their answers, or GRADIENT_SCORE_WAIT_MS after
the offers for a worker that has not answered: a cluster that meets an idle fleet is seated by
its scores, not by ties. The offers are job_score rows without a score, as a session's are, so
each pair is offered once per connection whichever process offers it.

- A pass asks for the clusters of its head only (GRADIENT_OFFER_WINDOW members of a kind, in
  the planner's order), each member of at most a window of its idle seats, chosen among a
  bounded number of candidates, in one statement: a new cluster beyond the head waits for a
  later pass, which places it only once asked (so it takes no seat meanwhile), and what one
  cluster costs does not grow with the idle fleet.
- A cluster asked before is asked again only when its placement would seat a member on a
  worker that never scored it (the seats that scored it are taken, and the others came free
  since, past their own heads), and of those seats alone, in rounds: a round holds it the
  score wait at most from its start (cluster_job.offered_at), and the next may begin a score
  wait after the last ended, so that a cluster is always placed in time however often seats
  come free.
- A new cluster is not asked of an idle worker still silent on an ask of the score wait's
  (an offer of a cluster asked lately, not answered): on a loaded server the answers queue
  in the sessions for seconds, past the score wait, and each further ask lengthens the queue
  without reaching a pass in time. The asks then follow the answers' pace.
"""

import json
import zlib
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from itertools import zip_longest

from django.conf import settings
from django.db import connection
from django.utils import timezone

from clusters import planner, statements
from clusters.book import StartableCluster
from gradient.postgresql.arrays import int_array, text_array
from gradient.wire.groups import send_frames
from workers.head import window
from workers.offers import RenderedOffer


def score_wait() -> timedelta:
    return timedelta(milliseconds=settings.GRADIENT["SCORE_WAIT_MS"])


class Asking:
    """One pass's view of which placements wait for scores: `ready` tells, placement by
    placement in the planner's order, offering the new clusters of the head as it meets them.
    The head holds the clusters that wait for answers and those asked in vain, up to a
    window of members of a kind; `due` is when the pass should run again for the clusters it
    held, None if it held none."""

    def __init__(self, clusters: list[StartableCluster], workers: tuple[planner.Worker, ...], now):
        self.now = now
        self.book = {c.id: c for c in clusters}
        self.seating = Seating(workers)
        self.left = Counter({kind: window() for kind in planner.KINDS})
        self.due: datetime | None = None
        self.held = 0  # placements held back this pass
        self.began = {c.id: c.offered_at for c in clusters}  # each one's round of asking
        self.asked: set[int] = set()  # clusters asked this pass
        self.tried: set[int] = set()  # clusters an offer statement ran for this pass
        self.counted: set[int] = set()  # clusters counted against the head
        self.rounds: list[int] = []  # clusters whose round of asking begins with this pass
        self.items: dict[int, list[str]] = defaultdict(list)  # worker -> its offer's jobs
        self.unanswered, self.silent = self._unanswered(clusters, {w.id for w in workers})

    def ask_new(self) -> None:
        """Offer the clusters that became able to start to the idle workers that could seat
        them, in the planner's order while the head has room, whether or not those are enough
        to place them yet: their scores are in by the time the last seat comes free."""
        if not score_wait():
            return
        new = [(c, None) for c in self.book.values() if self.began[c.id] is None]
        for cluster in self._offer(new, while_room=True):
            self._asked(cluster)
        self._send()  # before planning: the seats score while the pass plans

    def admits(self, planned: planner.Cluster) -> bool:
        """False for a cluster never asked while the head has no room for it: it is asked by a
        later pass, and not placed by this one, so its seats go to the clusters after it. (Were
        they kept, a deep queue's unasked clusters would hold most of the idle fleet while
        nothing is placed on it.) No wake-up of its own: the clusters filling the head wake
        the pass for their answers, and beat runs one within the dispatch interval anyway."""
        cluster = self.book[planned.id]
        if not score_wait() or self.began[cluster.id] is not None or self._fits(cluster):
            return True
        self.held += 1
        return False

    def ready(self, placement: planner.Placement) -> bool:
        """Whether an admitted placement is claimed now; False holds it, and its seats, for
        its seats' answers."""
        cluster = self.book[placement.cluster_id]
        if not score_wait():
            return True  # GRADIENT_SCORE_WAIT_MS=0: placed at once on the scores there are
        began = self.began[cluster.id]
        open_round = began is not None and self.now - began < score_wait()
        if began is not None and not open_round and placement.cost < planner.UNSCORED_COST:
            return True  # asked before and every seat chosen has its score: no blind seat
        may_ask = open_round or began is None or self.now - began >= 2 * score_wait()
        # Asked before: only the seats its placement would use unscored are asked; they alone
        # decide whether it waits, and a window of candidates again costs pairs, not placement.
        asked = cluster.id in self.asked or (
            may_ask and self._fits(cluster) and self._ask(cluster, placement, began is not None)
        )
        began = self.began[cluster.id]
        pending = any(m.key in self.unanswered for m in cluster.members)
        if began is not None and self.now - began < score_wait() and (asked or pending):
            self._count(cluster)
            self._hold(began)
            self.held += 1
            return False
        return True

    def _ask(
        self, cluster: StartableCluster, placement: planner.Placement | None, blind: bool
    ) -> bool:
        """Offer the cluster to its idle seats that never scored it (`blind`: its placement's
        unscored seats alone), and begin a round of asking unless one is open; whether any
        seat was asked."""
        if not self._offer([(cluster, placement)], blind=blind):
            return False
        self._asked(cluster)
        return True

    def _asked(self, cluster: StartableCluster) -> None:
        self.asked.add(cluster.id)
        began = self.began[cluster.id]
        if began is None or self.now - began >= score_wait():
            self.began[cluster.id] = self.now  # held at most the score wait from here
            self.rounds.append(cluster.id)

    def _fits(self, cluster: StartableCluster) -> bool:
        if cluster.id in self.counted:
            return True
        kinds = Counter(m.kind for m in cluster.members)
        return all(self.left[kind] >= n for kind, n in kinds.items())

    def _count(self, cluster: StartableCluster) -> None:
        if cluster.id not in self.counted:
            self.counted.add(cluster.id)
            self.left -= Counter(m.kind for m in cluster.members)

    def finish(self) -> None:
        """Send the offers made while planning and record their rounds."""
        self._send()

    def _send(self) -> None:
        """One JobOffer per worker, not waited for (a frame is a Redis round trip or three,
        which the pass must not spend per cluster); then when each round began."""
        if self.items:
            send_frames(
                [
                    (worker_id, RenderedOffer("[" + ",".join(jobs) + "]"))
                    for worker_id, jobs in self.items.items()
                ],
                event="worker.offer",
                # A lost offer only makes its cluster wait the score wait out.
                wait=False,
            )
            self.items.clear()
        if self.rounds:
            # A round runs from when its offers left, not from the pass's start: a slow pass
            # would otherwise spend its seats' score wait before they were asked.
            sent = timezone.now()
            with connection.cursor() as cursor:
                cursor.execute(
                    statements.MARK_SQL, {"now": sent, "clusters": int_array(self.rounds)}
                )
            self.rounds.clear()
            if self.due is not None:
                # The pass for the held clusters comes as late as their offers left: earlier,
                # it would find their seats' offers past the score wait and place them unanswered.
                self.due += sent - self.now

    def _hold(self, offered_at: datetime) -> None:
        due = offered_at + score_wait()
        self.due = due if self.due is None else min(self.due, due)

    def _unanswered(
        self, clusters: list[StartableCluster], idle: set[int]
    ) -> tuple[set[str], set[int]]:
        """The members an idle worker was offered lately and has not scored, and those
        workers."""
        since = self.now - score_wait()
        keys = [
            m.key
            for c in clusters
            if c.offered_at is not None and c.offered_at > since
            for m in c.members
        ]
        if not keys or not idle:
            return set(), set()
        members, silent = set(), set()
        with connection.cursor() as cursor:
            cursor.execute(statements.UNANSWERED_SQL, {"keys": text_array(keys), "since": since})
            for key, offered in cursor.fetchall():
                waited = idle.intersection(offered)
                if waited:
                    members.add(key)
                    silent |= waited
        return members, silent

    def _offer(self, asks: list, while_room: bool = False, blind: bool = False) -> list:
        """Offer each member of these clusters (with their placements, or None) to up to a
        window of idle workers that could seat it and were never offered it: first its
        placement's seats without a score, then (unless `blind`) its candidates
        (Seating.candidates). One statement for them all (their members never share a job), a
        cluster at most once a pass; `while_room`, up to the first that the head has no room
        for. The clusters any seat was offered."""
        workers, keys, turns = [], [], []
        cluster_of, chosen = {}, []
        for cluster, placement in asks:
            if while_room and not self._fits(cluster):
                break
            if cluster.id in self.tried:
                continue
            before = len(workers)
            self._candidates(cluster, placement, workers, keys, turns, blind)
            if len(workers) == before:
                continue
            self.tried.add(cluster.id)
            # Counted against the head whether or not a seat is found unasked: the statements
            # of a pass stay bounded by the window, however many placements use unscored seats.
            self._count(cluster)
            chosen.append(cluster)
            cluster_of.update((m.key, cluster) for m in cluster.members)
        if not workers:
            return []
        with connection.cursor() as cursor:
            cursor.execute(
                statements.ASK_SEATS_SQL,
                {
                    "now": self.now,
                    "workers": int_array(workers),
                    "keys": text_array(keys),
                    "turns": int_array(turns),
                    "per_member": ASKED * window(),
                },
            )
            fresh = cursor.fetchall()
        items = {m.key: _offered_json(m) for c in chosen for m in c.members}
        asked = {}
        for worker_id, offered in fresh:
            self.items[worker_id] += [items[key] for key in offered]
            asked.update((cluster_of[key].id, cluster_of[key]) for key in offered)
        return list(asked.values())

    def _candidates(
        self, cluster, placement, workers: list, keys: list, turns: list, blind: bool = False
    ) -> None:
        """Each member's candidate seats, in the order they are to be asked, appended."""
        unscored = defaultdict(list)
        for seat in placement.seats if placement is not None else ():
            if seat.missing_nar_size is None:
                unscored[seat.member.key].append(seat.worker)
        for member in cluster.members:
            start = zlib.crc32(member.key.encode())
            candidates = list(unscored[member.key])
            if not blind:
                # Not the seats still silent on an earlier ask (the module's docstring).
                candidates += [
                    w
                    for w in self.seating.candidates(member.planned(), start, CANDIDATES * window())
                    if w.id not in self.silent
                ]
            for turn, worker in enumerate(dict.fromkeys(candidates)):
                workers.append(worker.id)
                keys.append(member.key)
                turns.append(turn)


# Seats asked per member, in windows, of the first CANDIDATES windows of candidates that were
# never offered it, so that a large idle set is asked in turn. One window, not two: a pass's
# asks are most of its time and of a busy fleet's scored pairs, and placement kept its quality
# (docs/design.md).
ASKED = 1
CANDIDATES = 2


class Seating:
    """The pass's idle workers grouped by all the planner's eligibility looks at but the name,
    each group by zone: a member's seats are found per group, not per worker, and read from
    a place of the member's own, so that the clusters of a pass are not all asked of the same
    few workers. What one member costs is bounded by the groups and the window, not by the
    size of the idle fleet."""

    def __init__(self, workers: tuple[planner.Worker, ...]):
        groups: dict[tuple, dict[str | None, list[planner.Worker]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for worker in workers:
            groups[_profile(worker)][worker.zone].append(worker)
        self.groups = [(next(iter(zones.values()))[0], zones) for zones in groups.values()]
        self.by_name = {w.name: w for w in workers}

    def candidates(self, member: planner.Member, start: int, limit: int) -> list[planner.Worker]:
        """Up to `limit` workers that could seat the member, by the planner's own eligibility,
        taken in turn from each zone (a same_zone cluster has seats to choose among in every
        zone), each zone's read cyclically from `start`."""
        if member.pin is not None:
            pinned = self.by_name.get(member.pin)
            ok = pinned is not None and planner.seat_reason(member, pinned) is None
            return [pinned] if ok else []
        zones: dict[str | None, list[list[planner.Worker]]] = defaultdict(list)
        for sample, by_zone in self.groups:
            if planner.seat_reason(member, sample) is None:
                for zone, workers in by_zone.items():
                    zones[zone].append(workers)
        turns = zip_longest(*(_rotated(lists, start, limit) for lists in zones.values()))
        return [w for turn in turns for w in turn if w is not None][:limit]


def _rotated(lists: list[list], start: int, limit: int) -> list:
    """Up to `limit` items of the lists joined, read cyclically from item `start` (modulo
    their number), without joining them."""
    total = sum(map(len, lists))
    if not total:
        return []
    start %= total
    i = 0
    while start >= len(lists[i]):
        start -= len(lists[i])
        i += 1
    out: list = []
    want = min(limit, total)
    while len(out) < want:
        out += lists[i][start : start + want - len(out)]
        start, i = 0, (i + 1) % len(lists)
    return out


def _profile(worker: planner.Worker) -> tuple:
    return (
        worker.idle_kinds,
        worker.architectures,
        worker.features,
        worker.projects,
        worker.can_eval,
        worker.can_build,
        worker.quarantined,
    )


def _offered_json(member) -> str:
    return json.dumps(
        {
            "job_id": member.key,
            "kind": member.kind,
            "project": member.project,
            "architecture": member.architecture,
            "required_features": list(member.features),
            "paths": list(member.paths),
        }
    )
