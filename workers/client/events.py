"""A worker's record of what happened: one dict per event, {time, worker, event, ...fields}."""

import json
from datetime import UTC, datetime
from typing import Protocol


def now() -> str:
    return datetime.now(UTC).isoformat()


class EventSink(Protocol):
    """Where a worker's events go besides its in-memory deque: a file, an operator's log."""

    def write(self, event: dict) -> None: ...


class EventLog:
    """One JSON object per line, shared by every worker of a fleet. Line-buffered and appended,
    so a killed run leaves whole lines and several processes can share one file."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, event: dict) -> None:
        self._file.write(json.dumps(event, default=str) + "\n")

    def close(self) -> None:
        self._file.close()
