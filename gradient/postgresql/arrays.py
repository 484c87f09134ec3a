"""Long lists as one PostgreSQL array literal each, for a `%s::text[]` or `%s::bigint[]`
parameter: psycopg dumps a list element by element in Python, which for a JobScores answer
costs far more than PostgreSQL's parsing of one literal.
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
