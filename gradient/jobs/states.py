"""A state machine: which moves a status allows, and the guarded write that makes one.

A move is one conditional UPDATE whose WHERE holds `state = ANY(<the sources its target
allows>)`; the row count says how many moved. Every module's statements take that write from
here, whole or as a CTE, so each machine's table (next to its enum) is the one place a move is
allowed.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class IllegalTransition(ValueError):
    """A move the table does not have at all: a mistake in the caller, never a race."""


@dataclass(frozen=True)
class StateMachine:
    name: str
    table: str
    states: frozenset[str]
    # target -> the states it may be reached from; a state that is no key's source is final
    sources: Mapping[str, frozenset[str]]
    # SQL: the state of a row of `table` aliased {t} (its status, or what its columns mean),
    # and what a move to {to} at time {at} writes, by default and for the targets in `writes`.
    state: str = "{t}.status"
    write: str = "status = {to}"
    writes: Mapping[str, str] = field(default_factory=dict)

    def allowed(self, to: str, expect: Iterable[str] | None = None) -> frozenset[str]:
        """The states a row may move to `to` from, narrowed to `expect` when given."""
        if to not in self.sources:
            raise IllegalTransition(f"{self.name} cannot be moved to {to}")
        allowed = self.sources[to] if expect is None else self.sources[to] & frozenset(expect)
        if not allowed:
            raise IllegalTransition(f"{self.name} cannot move from {set(expect)} to {to}")
        return allowed

    def guard(self, t: str, param: str) -> str:
        """The guard, for a row aliased `t`, whose sources are bound to %(param)s."""
        return f"{self.state.format(t=t)} = ANY(%({param})s)"

    def update(
        self, name: str, where: str, *, to=None, at=None, also: str = "", returning: str = "id"
    ) -> str:
        """The guarded write in SQL, named `name`: moves the rows `where` selects to
        %(name_to)s at %(name_at)s (or the SQL `at`), those the table allows. `to` picks the
        write of a fixed target; `also` adds columns to the SET. Bind bind(name, ...)."""
        write = self.writes.get(to, self.write)
        sets = write.format(to=f"%({name}_to)s", at=at or f"%({name}_at)s")
        return (
            f"UPDATE {self.table} SET {sets}{also}\n"
            f"WHERE ({where}) AND {self.guard(self.table, f'{name}_from')}\n"
            f"RETURNING {returning}"
        )

    def bind(self, name: str, to: str, expect=None, *, at=None) -> dict:
        """The parameters of update(name, ...) for a move to `to`."""
        return {
            f"{name}_to": to,
            f"{name}_from": sorted(self.allowed(to, expect)),
            f"{name}_at": at,
        }

    def update_each(self, name: str) -> str:
        """The guarded write of many rows at once, each to its own target: %(name_ids)s,
        %(name_to)s and %(name_from)s are arrays, a row each, all at %(name_at)s (bind_each)."""
        return (
            f"UPDATE {self.table} SET {self.write.format(to='t.target', at=f'%({name}_at)s')}\n"
            f"FROM unnest(%({name}_ids)s, %({name}_to)s::text[], %({name}_from)s::text[])"
            " AS t(id, target, sources)\n"
            f"WHERE {self.table}.id = t.id"
            f" AND {self.state.format(t=self.table)} = ANY(string_to_array(t.sources, ','))"
        )

    def bind_each(self, name: str, moves: Iterable[tuple], *, at=None) -> dict:
        """The parameters of update_each(name) for (id, target, expect) moves."""
        rows = [(pk, to, ",".join(sorted(self.allowed(to, expect)))) for pk, to, expect in moves]
        return {
            f"{name}_ids": [pk for pk, _, _ in rows],
            f"{name}_to": [to for _, to, _ in rows],
            f"{name}_from": [sources for _, _, sources in rows],
            f"{name}_at": at,
        }
