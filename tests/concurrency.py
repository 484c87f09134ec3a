"""Run callables at the same instant on real, separate database connections."""

import threading
import time
from contextlib import contextmanager

import psycopg
from django.db import connection, transaction


def race(*calls, timeout=30):
    """Start every call in its own thread (so on its own connection) behind one barrier and
    return their results in order; an exception in any call is re-raised."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list = []

    def run(i, call):
        try:
            barrier.wait(timeout)
            results[i] = call()
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results


@contextmanager
def rows_locked(queryset, timeout=30):
    """Hold the queryset's rows FOR UPDATE in another transaction (a thread, so its own
    connection) until the block ends."""
    locked, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                list(queryset.select_for_update())
                locked.set()
                release.wait(timeout)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(timeout), "could not lock the rows"
        yield
    finally:
        release.set()
        holder.join(timeout)


def frozen_connection() -> psycopg.Connection:
    """A connection of its own, outside Django, to hold locks for as long as a test likes."""
    s = connection.settings_dict
    return psycopg.connect(dbname=s["NAME"], user=s["USER"], host=s["HOST"], port=s["PORT"] or 5432)


class Outcomes:
    """The ways a race may go, each of which a test must see: `rounds` goes on past
    `at_least` rounds until every one was seen, and fails after `at_most` if one never was."""

    def __init__(self, *names: str):
        self.named = set(names)
        self.seen: set[str] = set()

    def rounds(self, at_least: int, at_most: int = 60):
        for i in range(at_most):
            if i >= at_least and self.seen == self.named:
                return
            yield i
        assert self.seen == self.named, f"never seen in {at_most} rounds: {self.named - self.seen}"

    def saw(self, name: str):
        assert name in self.named, name
        self.seen.add(name)


# Head starts, cycled through the rounds: positive delays the second call, negative the first,
# so that either side of a race gets to win some rounds on a machine that favours one.
SKEWS = (0.0, 0.01, -0.01, 0.03, -0.03, 0.1, -0.1, 0.25, -0.25)


def skewed(first, second, i: int):
    skew = SKEWS[i % len(SKEWS)]

    def later(call, delay):
        def run():
            time.sleep(delay)
            return call()

        return run

    return later(first, max(0.0, -skew)), later(second, max(0.0, skew))
