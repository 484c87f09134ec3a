"""Structured logs: a record names its cluster, attempt and worker through `extra=ids(...)`,
and the JSON formatter emits them as fields, so a search can follow one cluster everywhere."""

import json
import logging
import uuid
from datetime import UTC, datetime

FIELDS = ("cluster", "attempt", "worker")


def _plain(value):
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return value


def ids(cluster=None, attempt=None, worker=None) -> dict:
    """The `extra=` of a log call: the ids given (a worker id, or a list of them), no others."""
    given = {"cluster": cluster, "attempt": attempt, "worker": worker}
    return {name: _plain(value) for name, value in given.items() if value is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the ids passed in `extra`."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = _plain(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)
