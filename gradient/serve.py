"""Several daphne processes on one listening socket.

    python -m gradient.serve -b HOST -p PORT [--processes N] [--backlog N] [-- DAPHNE-OPTIONS]

One daphne is one GIL. This binds HOST:PORT once, with a backlog long enough for a fleet
reconnecting at once, and starts N daphnes (default: one per core) that accept from it
(`daphne --fd`). Sessions keep their state in PostgreSQL, so which process serves a worker does
not matter. When one child dies the others are stopped and the launcher exits with its status,
so a supervisor restarts the whole.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

APPLICATION = "gradient.asgi:application"
DEFAULT_BACKLOG = 1024
STOP_GRACE_SECS = 10  # after SIGTERM, before SIGKILL
# Before the caller's own options, which win: in a reconnect storm a handshake may wait its
# turn, and a session is never closed for its age (README, "Processes").
DAPHNE_OPTIONS = ("--websocket_connect_timeout", "30", "--websocket_timeout", "-1")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m gradient.serve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("-b", "--bind", default="127.0.0.1", help="address to listen on")
    parser.add_argument("-p", "--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--processes",
        type=int,
        default=os.cpu_count() or 1,
        help="daphne processes sharing the socket (default: one per core)",
    )
    parser.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG, help="listen backlog")
    options, rest = parser.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if options.processes < 1:
        parser.error("--processes must be at least 1")
    if options.backlog < 1:
        parser.error("--backlog must be at least 1")
    if not 0 < options.port < 65536:
        parser.error("--port must be between 1 and 65535")
    return options, rest


def listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def daphne() -> str:
    # The daphne of this interpreter's environment, whether or not that is on PATH.
    beside = Path(sys.executable).with_name("daphne")
    return str(beside) if beside.exists() else shutil.which("daphne") or "daphne"


def main(argv: list[str] | None = None) -> int:
    options, extra = parse(sys.argv[1:] if argv is None else argv)
    try:
        sock = listen(options.bind, options.port, options.backlog)
    except OSError as exc:
        print(f"serve: cannot listen on {options.bind}:{options.port}: {exc}", file=sys.stderr)
        return 1
    fd = sock.fileno()
    command = [daphne(), "--fd", str(fd), *DAPHNE_OPTIONS, *extra, APPLICATION]
    children: list[subprocess.Popen] = []
    stopping = []

    def stop(*_):
        if not stopping:
            stopping.append(time.monotonic())
            for child in children:
                if child.poll() is None:
                    child.terminate()

    # Before the first child starts, so that a SIGTERM meanwhile stops them too.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in range(options.processes):
        if not stopping:
            children.append(subprocess.Popen(command, pass_fds=(fd,)))
    sock.close()  # the children hold it now
    print(
        f"serve: {len(children)} daphne on {options.bind}:{options.port}"
        f" (pids {' '.join(str(c.pid) for c in children)})",
        file=sys.stderr,
        flush=True,
    )
    first = None  # the first child to end on its own, whose status the launcher exits with
    while any(c.poll() is None for c in children):
        ended = [c for c in children if c.poll() is not None]
        if ended and not stopping:
            first = ended[0]
            print(f"serve: daphne {first.pid} exited ({first.returncode})", file=sys.stderr)
            stop()
        if stopping and time.monotonic() - stopping[0] > STOP_GRACE_SECS:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.1)
    if first is None:
        return 0  # stopped by a signal
    return first.returncode if first.returncode > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
