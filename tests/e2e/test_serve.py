"""The web launcher (gradient.serve) as the README runs it: several daphne processes on one
socket, stopped together."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, free_port, wait_for_port

pytestmark = pytest.mark.django_db(transaction=True)


def launch(processes, port: int, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "gradient.serve", "-b", "127.0.0.1", "-p", str(port), *args]
    return processes.start(f"serve-{port}", *command)


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def wait_for_children(pid: int, count: int, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = children(pid)
        if len(found) == count:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"{pid} has children {children(pid)}, not {count}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def accepted_on(port: int) -> set[str]:
    """Inodes of the established server-side TCP sockets on the port."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        if local_port == port and fields[3] == "01":  # ESTABLISHED
            inodes.add(fields[9])
    return inodes


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status


def wait_for_http(url: str, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return get(url)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_each_daphne_serves_from_the_one_socket_while_the_other_is_stopped(processes):
    port = free_port()
    launcher = launch(processes, port, "--processes", "2")
    daphnes = wait_for_children(launcher.pid, 2)
    url = f"http://127.0.0.1:{port}/admin/login/"
    assert wait_for_http(url) == 200
    # A stopped daphne accepts nothing: every connection then goes to the other one, on the
    # same port, and is served.
    for frozen, serving in (daphnes, reversed(daphnes)):
        os.kill(frozen, signal.SIGSTOP)
        try:
            held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
            assert all(get(url) == 200 for _ in range(5))
            time.sleep(0.2)
            mine = socket_inodes(serving) & accepted_on(port)
            assert len(mine) >= 5
            assert not socket_inodes(frozen) & accepted_on(port)
            for conn in held:
                conn.close()
        finally:
            os.kill(frozen, signal.SIGCONT)


def test_sigterm_stops_every_daphne_and_exits_zero(processes):
    port = free_port()
    launcher = launch(processes, port, "--processes", "2")
    daphnes = wait_for_children(launcher.pid, 2)
    wait_for_port(port, launcher)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(20) == 0
    assert not any(alive(pid) for pid in daphnes)


def test_a_dead_daphne_stops_the_others_and_the_launcher_fails(processes):
    port = free_port()
    launcher = launch(processes, port, "--processes", "2")
    first, second = wait_for_children(launcher.pid, 2)
    wait_for_http(f"http://127.0.0.1:{port}/admin/login/")
    os.kill(first, signal.SIGKILL)
    assert launcher.wait(20) != 0
    assert not alive(second)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    assert f"daphne {first} exited" in processes.log_text(f"serve-{port}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--processes", "0"], "--processes must be at least 1"),
        (["--processes", "two"], "invalid int value"),
        (["--backlog", "0"], "--backlog must be at least 1"),
    ],
)
def test_bad_arguments_exit_non_zero_and_start_nothing(args, message):
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "gradient.serve", "-p", str(port), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert message in done.stderr
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_a_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gradient.serve", "-b", "127.0.0.1", "-p", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"serve: cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use"
    ]
