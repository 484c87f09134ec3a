"""gradient-worker signal send|wait: a member's signals from a shell, through its agent's
GRADIENT_SIGNAL_SOCKET (protocol.md, "Signals between members").

    gradient-worker signal send [--to ROLE/INDEX] PAYLOAD_JSON
    gradient-worker signal wait [--from ROLE/INDEX] [--timeout SECS]

Exit status: 0 once the signal was handed over (send) or a matching payload was printed (wait);
1 when it may go better later: the agent has no connection to the server now, its socket
cannot be reached, or no matching signal came before the timeout or the socket's end; 2 for
a mistake of the caller: bad arguments, a payload that is not JSON or is over 64 KiB, no
GRADIENT_SIGNAL_SOCKET (outside a member), or a line the agent refused. Errors are one line
on stderr.
"""

import argparse
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterator

from workers.agent.signals import NOT_CONNECTED, BadLine, checked_signal, loads

PROG = "gradient-worker signal"
SOCKET_VARIABLE = "GRADIENT_SIGNAL_SOCKET"
MEMBER = re.compile(r"(?P<role>.+)/(?P<index>[0-9]+)")


class Failure(Exception):
    """Ends the command with one line on stderr and an exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise Failure(message.replace("\n", " "))


def _member(text: str) -> dict:
    match = MEMBER.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROLE/INDEX (e.g. server/0)")
    return {"role": match["role"], "index": int(match["index"])}


def _seconds(text: str) -> float:
    try:
        secs = float(text)
    except ValueError:
        secs = math.nan
    if not (math.isfinite(secs) and secs > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return secs


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Signals between the members of a cluster.")
    commands = parser.add_subparsers(dest="command", required=True)
    send = commands.add_parser("send", help="send a signal to the other members, or to one")
    send.add_argument("--to", type=_member, metavar="ROLE/INDEX", help="only this member")
    send.add_argument("payload", metavar="PAYLOAD_JSON", help="any JSON value, at most 64 KiB")
    wait = commands.add_parser("wait", help="print the first signal received (or to come)")
    wait.add_argument("--from", dest="sender", type=_member, metavar="ROLE/INDEX")
    wait.add_argument("--timeout", type=_seconds, metavar="SECS", help="exit 1 after this")
    return parser


def _connect() -> socket.socket:
    path = os.environ.get(SOCKET_VARIABLE)
    if not path:
        raise Failure(f"{SOCKET_VARIABLE} is not set: signals are for the members of a cluster")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise Failure(f"cannot reach the agent at {path}: {exc.strerror or exc}", 1) from None
    return sock


def _lines(sock: socket.socket, deadline: float | None = None) -> Iterator[bytes]:
    """The lines the agent writes until it closes; TimeoutError once the deadline passes."""
    buffer = b""
    while True:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(65536)
        if not chunk:
            return
        *lines, buffer = (buffer + chunk).split(b"\n")
        yield from lines


def send(to: dict | None, text: str) -> None:
    try:
        payload = loads(text)
    except (ValueError, RecursionError) as exc:
        raise Failure(f"PAYLOAD_JSON is not JSON: {exc}") from None
    try:
        checked_signal({"to": to, "payload": payload})
    except BadLine as exc:
        raise Failure(str(exc)) from None
    with _connect() as sock:
        try:
            sock.sendall(json.dumps({"to": to, "payload": payload}).encode() + b"\n")
            # Half-closing asks the agent to end the connection once the line is handled: a
            # close without an error line means the signal was handed over.
            sock.shutdown(socket.SHUT_WR)
            # The signals received so far come first, then the answer to the line, if any.
            errors = [m["error"] for m in map(json.loads, _lines(sock)) if "error" in m]
        except OSError as exc:
            raise Failure(f"lost the agent's signal socket: {exc.strerror or exc}", 1) from None
    if errors:
        raise Failure(errors[0], 1 if errors[0] == NOT_CONNECTED else 2)


def wait(sender: dict | None, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    with _connect() as sock:
        try:
            for line in _lines(sock, deadline):
                signal = json.loads(line)
                if "from" in signal and sender in (None, signal["from"]):
                    print(json.dumps(signal["payload"]))
                    return
        except TimeoutError:
            raise Failure(f"no matching signal within {timeout:g} seconds", 1) from None
        except OSError as exc:
            raise Failure(f"lost the agent's signal socket: {exc.strerror or exc}", 1) from None
    raise Failure("the agent closed the signal socket: the member's job has ended", 1)


def main(argv: list[str]) -> int:
    """argv: what follows `gradient-worker signal`."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "send":
            send(args.to, args.payload)
        else:
            wait(args.sender, args.timeout)
    except Failure as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
