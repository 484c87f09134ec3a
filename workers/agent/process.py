"""One job as a real process, and its end (protocol.md, "Running real work": "A run",
"Outcome", "Ending processes").

The job's first process leads a session of its own, so its group holds everything it starts
that does not leave on purpose. Every signal to that group is sent while the leader is still
unreaped (alive, or a zombie we have not waited for): its pid is the group's id, and the kernel
cannot hand that number to another process before we reap it. Linux only (/proc, prctl).
"""

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gradient.wire.protocol import MAX_LOG_TAIL_BYTES

OUTPUT_LOG = "output.log"
# Present while the job's group may have members: what end_leftovers needs to find them.
GROUP_RECORD = "group.json"
# The caller puts it in every job's environment; its processes inherit it.
MARKER_VAR = "GRADIENT_ASSIGNMENT_ID"
TRANSIENT_STATUS = os.EX_TEMPFAIL
# How long a process may outlive SIGKILL (uninterruptible sleep) before wait() reports anyway.
SETTLE_SECS = 5.0
# Rounds of a /proc scan for a group without its leader: a member may fork while we kill.
LEFTOVER_ROUNDS = 5

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
# util-linux's setpriv sets the parent-death signal and execs the job: the agent then spawns
# without Python in the child, which lets it vfork instead of copying its own memory.
SETPRIV = shutil.which("setpriv")


@dataclass(frozen=True)
class Outcome:
    completed: bool
    kind: str | None  # "transient", "permanent", "timeout", "aborted" when not completed
    error: str | None
    elapsed_ms: int
    log_tail: str


class JobProcess:
    """The job's `argv` run in `directory` (WORKDIR/ASSIGNMENT_ID) with exactly `env`."""

    def __init__(
        self,
        directory: Path,
        argv: list[str],
        env: dict[str, str],
        *,
        timeout_secs: int | None,
        kill_grace: float,
    ):
        self.directory = Path(directory)
        self.argv = list(argv)
        self.env = dict(env)
        self.timeout_secs = timeout_secs
        self.kill_grace = kill_grace
        self.pid: int | None = None
        self.started_at: float = time.monotonic()
        self._popen: subprocess.Popen | None = None
        self._cannot_start: str | None = None
        self._ending: tuple[str, str] | None = None  # (kind, error) of an abort or the timeout
        self._reaped = False
        self._returncode: int | None = None
        self._ended_at: float | None = None
        self._finished: asyncio.Future | None = None
        self._escalation: asyncio.Task | None = None
        self._deadline: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """Make the fresh directory and spawn. Never raises for a job that cannot start:
        wait() then reports it."""
        if self._finished is not None:
            raise RuntimeError("a JobProcess starts once")
        loop = asyncio.get_running_loop()
        self._finished = loop.create_future()
        self.started_at = time.monotonic()
        if self._ending is not None:  # aborted before it ran
            return
        if not self.argv:
            self._cannot_start = "the job has no command"
            return
        try:
            _make_fresh(self.directory)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            output = os.open(self.directory / OUTPUT_LOG, flags, 0o644)
        except OSError as error:
            self._cannot_start = f"cannot make {self.directory}: {error.strerror or error}"
            return
        # Spawned on the event loop's thread, which lives as long as the agent: the parent-death
        # signal fires when the thread that forked ends. Popen, not create_subprocess_exec: its
        # child watcher would reap the leader at once, freeing the group's id before we end it.
        try:
            argv, dies_with = self._spawned_argv()
            self._popen = subprocess.Popen(
                argv,
                cwd=self.directory,
                env=self.env,
                stdin=subprocess.DEVNULL,
                # A file, not a pipe: nothing to pump, and the output survives the agent.
                stdout=output,
                stderr=subprocess.STDOUT,
                # A session of its own: its group can be signalled whole, and a terminal's
                # Ctrl-C reaches the agent alone.
                start_new_session=True,
                preexec_fn=dies_with,
            )
        except (OSError, ValueError) as error:
            self._cannot_start = _why_not_started(self.argv[0], error)
            return
        finally:
            os.close(output)
        self.pid = self._popen.pid
        _notice_exit(self.pid, loop, self._on_exit)
        if self.timeout_secs is not None:
            error = f"timed out after {self.timeout_secs} s"
            self._deadline = loop.call_later(self.timeout_secs, self._end, "timeout", error)
        try:
            _write_record(self.directory, self.pid, self.env.get(MARKER_VAR))
        except OSError as error:  # unrecorded, a group could outlive a crash of the agent
            self._end("permanent", f"cannot record the job's process group: {error}")

    def _spawned_argv(self) -> tuple[list[str], object]:
        """The argv to spawn, and what runs in the child before exec (None: nothing)."""
        if SETPRIV is None:
            return self.argv, _dies_with(os.getpid())
        # setpriv would only report a command it cannot exec in the job's output: tell it here.
        program = self.argv[0]
        if "/" in program:
            found = os.path.join(self.directory, program)  # the job's directory is its cwd
        else:
            found = shutil.which(program, path=self.env.get("PATH"))
        if found is None or not os.path.isfile(found):
            raise FileNotFoundError(program)
        if not os.access(found, os.X_OK):
            raise PermissionError(program)
        return [SETPRIV, "--pdeathsig", "KILL", "--", *self.argv], None

    async def wait(self) -> Outcome:
        """Until the first process exits (or the timeout ends the group); then its group's
        remains are killed and the outcome told."""
        if self._finished is None:
            raise RuntimeError("wait() before start()")
        if self._popen is None:  # it could not start, or was aborted before it ran
            kind, error = ("permanent", self._cannot_start) if self._cannot_start else self._ending
            return Outcome(False, kind, error, 0, log_tail(self.directory / OUTPUT_LOG))
        # The job's own length, unless an ending began (an abort, the timeout): then SIGKILL
        # after kill_grace and SETTLE_SECS bound it.
        await self._finished
        return self._outcome()

    async def abort(self, reason: str) -> None:
        """SIGTERM to the group now, SIGKILL kill_grace seconds later; returns at once and
        wait() reports kind "aborted". Changes nothing once the job has ended."""
        self._end("aborted", reason)

    def _end(self, kind: str, error: str) -> None:
        if self._ending is not None or self._reaped:  # the first ending, or the exit, decides
            return
        self._ending = (kind, error)
        if self._popen is None:
            return
        self._signal_group(signal.SIGTERM)
        self._escalation = asyncio.get_running_loop().create_task(self._escalate())

    async def _escalate(self) -> None:
        await asyncio.sleep(self.kill_grace)
        self._signal_group(signal.SIGKILL)
        await asyncio.sleep(SETTLE_SECS)
        # Still not gone after SIGKILL: report anyway; _on_exit reaps it whenever it goes.
        if not self._finished.done():
            self._ended_at = time.monotonic()
            self._finished.set_result(None)

    def _on_exit(self) -> None:
        """The leader has exited and is not yet reaped: end its group, then reap it."""
        if self._reaped:
            return
        self._signal_group(signal.SIGKILL)
        self._returncode = self._popen.wait()  # a zombie already: returns at once
        self._reaped = True
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        for pending in (self._escalation, self._deadline):
            if pending is not None:
                pending.cancel()
        _remove_record(self.directory)
        if not self._finished.done():
            self._finished.set_result(None)

    def _signal_group(self, sig: signal.Signals) -> None:
        # Only while the leader is unreaped: its pid, the group's id, cannot be reused yet.
        if self._popen is not None and not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, sig)

    def _outcome(self) -> Outcome:
        elapsed_ms = int(((self._ended_at or time.monotonic()) - self.started_at) * 1000)
        tail = log_tail(self.directory / OUTPUT_LOG)
        if self._ending is not None:
            kind, error = self._ending
            return Outcome(False, kind, error, elapsed_ms, tail)
        kind, error = outcome_of(self._returncode)
        return Outcome(kind is None, kind, error, elapsed_ms, tail)


def outcome_of(returncode: int) -> tuple[str | None, str | None]:
    """(kind, error) for how the first process ended; (None, None) when it completed."""
    if returncode == 0:
        return None, None
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return "permanent", f"killed by signal {name}"
    kind = "transient" if returncode == TRANSIENT_STATUS else "permanent"
    return kind, f"exited with status {returncode}"


def _why_not_started(program: str, error: Exception) -> str:
    if isinstance(error, FileNotFoundError):
        return f"command not found: {program}"
    if isinstance(error, PermissionError):
        return f"not executable: {program}"
    reason = error.strerror if isinstance(error, OSError) and error.strerror else error
    return f"cannot start {program}: {reason}"


def _dies_with(parent: int):
    """Runs in the child between fork and exec: SIGKILL it when the agent ends, however."""

    # Between fork and exec only prctl, getppid and kill run: no lock that another thread of
    # the agent could have held at the fork.
    def set_parent_death_signal() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The agent may have died before prctl took effect: then nobody will send it.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return set_parent_death_signal


def _notice_exit(pid: int, loop: asyncio.AbstractEventLoop, callback) -> None:
    """Call `callback` on the loop once `pid` has exited, leaving it unreaped (WNOWAIT)."""

    def watch() -> None:
        # ChildProcessError: already reaped; the callback then finds nothing left to do.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is ending
            loop.call_soon_threadsafe(callback)

    # A thread blocked in waitid: no polling, on any kernel, and the loop thread stays free.
    threading.Thread(target=watch, name=f"job-exit-{pid}", daemon=True).start()


def _make_fresh(directory: Path) -> None:
    if directory.exists() or directory.is_symlink():
        shutil.rmtree(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir()


# The group record, and finding a group again after the agent that made it died.


@dataclass(frozen=True)
class _Proc:
    pid: int
    pgid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)


def _stat(pid: int) -> _Proc | None:
    """None for a process that is gone or a zombie (nothing left to kill)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow its last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return _Proc(pid, int(fields[2]), int(fields[19]))


def _carries(pid: int, marker: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's: not the job's
        return False
    return marker.encode() in environ.split(b"\0")


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _write_record(directory: Path, pid: int, assignment_id: str | None) -> None:
    leader = _stat(pid)
    record = {
        "pgid": pid,
        "start_time": leader.start_time if leader else None,
        "boot_id": _boot_id(),
        "marker": f"{MARKER_VAR}={assignment_id}" if assignment_id is not None else None,
    }
    # Written whole or not at all: an agent killed mid-write leaves no half record.
    partial = directory / f".{GROUP_RECORD}.tmp"
    partial.write_text(json.dumps(record))
    partial.replace(directory / GROUP_RECORD)


def _remove_record(directory: Path) -> None:
    (directory / GROUP_RECORD).unlink(missing_ok=True)


def _live_processes() -> list[_Proc]:
    procs = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (proc := _stat(int(entry.name))) is not None:
            procs.append(proc)
    return procs


def _members(record: dict) -> tuple[bool, list[int]]:
    """(whether the leader lives, the job's live processes). With its leader, the job's group
    is all of it; without, only the processes of the group carrying the job's marker: another
    process that took the leader's pid, or its group's id, is never taken for the job's."""
    pgid, marker = record["pgid"], record.get("marker")
    group = [proc for proc in _live_processes() if proc.pgid == pgid and proc.pid != os.getpid()]
    if any(proc.pid == pgid and proc.start_time == record.get("start_time") for proc in group):
        return True, [proc.pid for proc in group]
    if marker is None:
        return False, []
    return False, [proc.pid for proc in group if _carries(proc.pid, marker)]


def _end_group(record: dict) -> int:
    """SIGKILL what is left of a recorded group; how many processes that was."""
    pgid = record["pgid"]
    if pgid == os.getpgrp():  # never the agent's own group
        return 0
    ended: set[int] = set()
    for _ in range(LEFTOVER_ROUNDS):
        leader_alive, members = _members(record)
        if not set(members) - ended:
            break
        ended.update(members)
        if leader_alive:  # the group is the job's: members without the marker go too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        else:
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return len(ended)


def end_leftovers(workdir: Path) -> list[str]:
    """At agent start: end the process groups a previous run of the agent left in `workdir`.
    One line per group found, for the log."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        return []
    boot_id = _boot_id()
    lines = []
    for path in sorted(workdir.glob(f"*/{GROUP_RECORD}")):
        try:
            record = json.loads(path.read_text())
            int(record["pgid"])
        except (OSError, ValueError, KeyError, TypeError):
            lines.append(f"{path}: unreadable, ignored")
            path.unlink(missing_ok=True)
            continue
        where = f"process group {record['pgid']} left in {path.parent}"
        if record.get("boot_id") != boot_id:  # the machine restarted since: all gone
            lines.append(f"{where}: gone with the previous boot")
        elif count := _end_group(record):
            lines.append(f"{where}: ended {count} process{'es' if count > 1 else ''}")
        else:
            lines.append(f"{where}: had already ended")
        path.unlink(missing_ok=True)
    return lines


def prune(workdir: Path, keep: int) -> None:
    """Remove the directories of finished jobs but the `keep` newest. A directory with a group
    record is a running job's (or a leftover not yet ended) and stays."""
    if keep < 0:
        raise ValueError(f"keep must be 0 or more, not {keep}")
    workdir = Path(workdir)
    if not workdir.is_dir():
        return
    finished = [
        entry
        for entry in os.scandir(workdir)
        if entry.is_dir(follow_symlinks=False) and not Path(entry.path, GROUP_RECORD).exists()
    ]
    finished.sort(key=lambda entry: entry.stat(follow_symlinks=False).st_mtime_ns, reverse=True)
    for entry in finished[keep:]:
        shutil.rmtree(entry.path, ignore_errors=True)


def log_tail(path: Path) -> str:
    """The end of a job's output as text for a report: at most MAX_LOG_TAIL_BYTES in UTF-8,
    invalid bytes and NUL (which the server cannot store) replaced. Reads only the end."""
    try:
        with open(path, "rb") as output:
            size = output.seek(0, os.SEEK_END)
            output.seek(max(size - MAX_LOG_TAIL_BYTES, 0))
            data = output.read(MAX_LOG_TAIL_BYTES)
    except OSError:
        return ""
    if size > MAX_LOG_TAIL_BYTES:
        data = data[_continuation_bytes(data) :]  # cut mid-file: not half a character
    text = data.decode("utf-8", errors="replace").replace("\0", "\ufffd")
    encoded = text.encode()
    if len(encoded) > MAX_LOG_TAIL_BYTES:  # replacements take 3 bytes for 1
        text = encoded[-MAX_LOG_TAIL_BYTES:].decode("utf-8", errors="ignore")
    return text


def _continuation_bytes(data: bytes) -> int:
    """How many bytes at the start of `data` continue a character begun before it (at most 3,
    the most a UTF-8 character has)."""
    count = 0
    while count < min(3, len(data)) and data[count] & 0xC0 == 0x80:
        count += 1
    return count
