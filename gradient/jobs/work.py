"""The work a job carries (protocol.md, "Running real work"): `command`, `env` and
`timeout_secs`, checked here for every way in, and a report's `log_tail` as the server keeps it.
Sizes are those of the compact UTF-8 JSON the value is stored and sent as.
"""

import json
import re
from typing import Any

from gradient.jobs.management.json_command import text_problem
from gradient.wire.protocol import MAX_LOG_TAIL_BYTES

MAX_ARGUMENTS = 64
MAX_COMMAND_BYTES = 64 * 1024
MAX_ENV_BYTES = 16 * 1024
MAX_TIMEOUT_SECS = 7 * 24 * 3600
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The agent's own variables (GRADIENT_JOB_ID, GRADIENT_ROSTER, ...): a job cannot set them.
RESERVED_PREFIX = "GRADIENT_"
# A JobFailed's error is a line saying what went wrong; what is longer is cut at its end.
MAX_ERROR_CHARS = 4096

# What a job without work carries in its AssignJob.
NO_WORK = {"command": None, "env": {}, "timeout_secs": None}


class WorkError(ValueError):
    """A value a job cannot carry; `field` names it, the message says why in a line."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


def _encoded_size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def check_command(command: Any) -> None:
    """null, or a list of 1 to MAX_ARGUMENTS non-empty strings, MAX_COMMAND_BYTES at most."""
    if command is None:
        return
    if not isinstance(command, list) or not 1 <= len(command) <= MAX_ARGUMENTS:
        raise WorkError("command", f"must be a JSON array of 1 to {MAX_ARGUMENTS} strings, or null")
    for i, argument in enumerate(command):
        if not isinstance(argument, str):
            raise WorkError("command", f"argument {i} is not a string")
        if not argument:
            raise WorkError("command", f"argument {i} is empty")
        problem = text_problem(argument)
        if problem:
            raise WorkError("command", f"argument {i} {problem}")
    if _encoded_size(command) > MAX_COMMAND_BYTES:
        raise WorkError("command", f"is over {MAX_COMMAND_BYTES} bytes as JSON")


def check_env(env: Any) -> None:
    """An object of NAME: VALUE strings, no NAME starting with GRADIENT_, MAX_ENV_BYTES at most."""
    if not isinstance(env, dict):
        raise WorkError("env", "must be a JSON object of names to strings")
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise WorkError("env", f"name {name!r} is not [A-Za-z_][A-Za-z0-9_]*")
        if name.startswith(RESERVED_PREFIX):
            raise WorkError("env", f"name {name!r} starts with {RESERVED_PREFIX}, the agent's own")
        if not isinstance(value, str):
            raise WorkError("env", f"the value of {name} is not a string")
        problem = text_problem(value)
        if problem:
            raise WorkError("env", f"the value of {name} {problem}")
    if _encoded_size(env) > MAX_ENV_BYTES:
        raise WorkError("env", f"is over {MAX_ENV_BYTES} bytes as JSON")


def check_timeout(timeout_secs: Any) -> None:
    """null, or a whole number of seconds from 1 to MAX_TIMEOUT_SECS (a week)."""
    if timeout_secs is None:
        return
    is_int = isinstance(timeout_secs, int) and not isinstance(timeout_secs, bool)
    if not is_int or not 1 <= timeout_secs <= MAX_TIMEOUT_SECS:
        raise WorkError("timeout_secs", f"must be an integer from 1 to {MAX_TIMEOUT_SECS}, or null")


def check_work(command: Any, env: Any, timeout_secs: Any) -> None:
    """Every rule of a job's work; the first value that breaks one raises WorkError."""
    check_command(command)
    check_env(env)
    check_timeout(timeout_secs)


def kept_log_tail(log_tail: str | None) -> str | None:
    """The last MAX_LOG_TAIL_BYTES of a report's log_tail, cut on a character boundary."""
    if log_tail is None:
        return None
    data = log_tail.encode()
    if len(data) <= MAX_LOG_TAIL_BYTES:
        return log_tail
    # The cut may fall inside a character: its remaining bytes are dropped with it.
    return data[-MAX_LOG_TAIL_BYTES:].decode(errors="ignore")


def kept_error(error: str | None) -> str | None:
    """A JobFailed's error as kept: its first MAX_ERROR_CHARS characters, NULs (which the wire
    allows there and PostgreSQL text does not) replaced."""
    if error is None:
        return None
    return error[:MAX_ERROR_CHARS].replace("\x00", "\N{REPLACEMENT CHARACTER}")
