"""Array literals (gradient.postgresql.arrays) read back by PostgreSQL exactly as given."""

import pytest
from django.db import connection

from gradient.postgresql.arrays import int_array, text_array

pytestmark = pytest.mark.django_db

AWKWARD = [
    "eval:3f1c0d1e-0000-4000-8000-000000000000",
    "a,b",
    "{braces}",
    'say "hi"',
    "back\\slash",
    '\\"',
    "NULL",
    "",
    " spaced ",
    "ünïcode ✓",
]


def read_back(literal: str, cast: str):
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT %s::{cast}", [literal])
        return cursor.fetchone()[0]


@pytest.mark.parametrize("values", [AWKWARD, AWKWARD[:1], [], ["NULL"], ['"', "\\"]])
def test_text_array_round_trips(values):
    assert read_back(text_array(values), "text[]") == values


@pytest.mark.parametrize("values", [[0, 1, 2**63 - 1, -(2**63)], [], [42]])
def test_int_array_round_trips(values):
    assert read_back(int_array(values), "bigint[]") == values


def test_int_array_takes_a_generator():
    assert read_back(int_array(n * n for n in range(4)), "bigint[]") == [0, 1, 4, 9]
