"""The agent's log: one line per event on standard error, as text (time, level, event, then
key=value fields) or as JSON lines (`--log-format json`), which tests and log shippers read.
Signal payloads are the job's business and never logged."""

import json
import sys
from typing import TextIO

# Events an operator should notice; the rest are the agent going about its work.
WARNINGS = {"connect_failed", "disconnected", "rejected", "failed", "aborting", "released_hold"}
ERRORS = {"error", "run_error", "fatal", "cleanup_failed", "signal_send_failed"}
HIDDEN = {"payload"}


def level(event: dict) -> str:
    name = event["event"]
    if name in ERRORS:
        return "error"
    return "warning" if name in WARNINGS else "info"


def _text_value(value) -> str:
    if isinstance(value, str) and value and not any(c in value for c in ' "=\n\t'):
        return value
    return json.dumps(value, separators=(",", ":"), default=str)


def text_line(event: dict) -> str:
    fields = " ".join(
        f"{key}={_text_value(value)}"
        for key, value in event.items()
        if key not in ("time", "event") and key not in HIDDEN and value is not None
    )
    head = f"{event['time']} {level(event).upper()} {event['event']}"
    return f"{head} {fields}" if fields else head


def json_line(event: dict) -> str:
    body = {"time": event["time"], "level": level(event), "event": event["event"]}
    body |= {k: v for k, v in event.items() if k not in body and k not in HIDDEN}
    return json.dumps(body, default=str)


class Log:
    """The agent's event sink (workers.client's EventSink)."""

    def __init__(self, log_format: str = "text", stream: TextIO | None = None):
        self._format = json_line if log_format == "json" else text_line
        self._stream = stream or sys.stderr

    def write(self, event: dict) -> None:
        self._stream.write(self._format(event) + "\n")
        self._stream.flush()
