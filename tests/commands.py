"""Operator commands run in this process or as real processes against the test database."""

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

from django.core.management import call_command
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def run(*args) -> dict:
    out = StringIO()
    call_command(*args, stdout=out)
    (line,) = out.getvalue().splitlines()
    return json.loads(line)


def manage(*args, input: str | None = None) -> subprocess.CompletedProcess:
    """`python manage.py ARGS` in its own process, `input` on its standard input; the caller's
    test must commit its rows (transaction=True) for the process to see them."""
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": "postgres://{USER}:{PASSWORD}@{HOST}:{PORT}/{NAME}".format(
            **{k: db[k] or "" for k in ("USER", "PASSWORD", "HOST", "PORT", "NAME")}
        ),
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=60,
    )
