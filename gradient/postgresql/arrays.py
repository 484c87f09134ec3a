"""Long lists as one PostgreSQL array literal each, for a `%s::text[]` or `%s::bigint[]`
parameter.

psycopg dumps a Python list element by element in Python (a dumper lookup and a check for
each), which for a JobScores answer costs far more than PostgreSQL's reading of it. The same
values as one literal ("{...}", parsed by PostgreSQL's array input) skip that work. The batch
claims pass their rows as JSON for the same reason.
"""

from collections.abc import Iterable, Sequence


def text_array(values: Sequence[str]) -> str:
    """The array literal of these strings: every element double-quoted, so that a comma, a
    brace, a space or the word NULL stays text; quotes and backslashes escaped."""
    if not values:
        return "{}"
    plain = "".join(values)
    if '"' in plain or "\\" in plain:
        values = [v.replace("\\", "\\\\").replace('"', '\\"') for v in values]
    return '{"' + '","'.join(values) + '"}'


def int_array(values: Iterable[int]) -> str:
    """The array literal of these integers."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"
