"""The agent's log lines: one per event, text or JSON, and never a signal's payload."""

import io
import json

from workers.agent.log import Log

EVENT = {
    "time": "2026-01-02T03:04:05+00:00",
    "worker": "w1",
    "event": "signal_received",
    "attempt": "a",
    "from": {"role": "db", "index": 0},
    "payload": {"secret": "s3cret"},
    "zone": None,
}


def written(log_format: str, event: dict) -> str:
    stream = io.StringIO()
    Log(log_format, stream).write(event)
    return stream.getvalue()


def test_a_text_line_has_the_time_level_event_and_fields_but_no_payload():
    line = written("text", EVENT)
    assert line == (
        "2026-01-02T03:04:05+00:00 INFO signal_received worker=w1 attempt=a"
        ' from={"role":"db","index":0}\n'
    )


def test_a_value_with_spaces_is_quoted_so_the_line_still_splits_into_fields():
    event = {"time": "t", "event": "failed", "error": "exited with status 3"}
    assert written("text", event) == 't WARNING failed error="exited with status 3"\n'


def test_a_json_line_carries_the_level_and_every_field_but_the_payload():
    body = json.loads(written("json", EVENT))
    assert body["level"] == "info" and body["event"] == "signal_received"
    assert "payload" not in body and body["from"] == {"role": "db", "index": 0}
    assert json.loads(written("json", {"time": "t", "event": "fatal"}))["level"] == "error"
