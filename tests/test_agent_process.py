"""gradient-worker's runs as real processes (protocol.md, "Running real work": "A run",
"Outcome", "Ending processes"): real shells, real signals, a real parent that dies."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradient.wire.protocol import MAX_LOG_TAIL_BYTES
from workers.agent.process import (
    GROUP_RECORD,
    OUTPUT_LOG,
    JobProcess,
    end_leftovers,
    log_tail,
    prune,
)

ROOT = Path(__file__).resolve().parents[1]
GRACE = 0.5
BOUND = 10.0  # seconds any one thing may take here before the test fails

# A stand-in agent: runs one job with its own environment, prints the job's pid, and waits.
AGENT = """
import asyncio, os, sys
from pathlib import Path
from workers.agent import process
from workers.agent.process import JobProcess

if os.environ.get("SPAWN") == "preexec":  # as on a machine without util-linux's setpriv
    process.SETPRIV = None

async def main():
    job = JobProcess(Path(sys.argv[1]), sys.argv[2:], dict(os.environ), timeout_secs=None,
                     kill_grace=0.5)
    await job.start()
    print(job.pid, flush=True)
    await job.wait()

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody reaped yet (dead all the same)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


async def eventually(condition, within: float = BOUND) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.02)


def env(assignment_id: str = "a1", **extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "GRADIENT_ASSIGNMENT_ID": assignment_id, **extra}


@pytest.fixture
def strays():
    """Pids a test started outside a JobProcess; killed at the end whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def run(directory: Path, script: str, **options) -> JobProcess:
    options.setdefault("timeout_secs", None)
    options.setdefault("kill_grace", GRACE)
    job = JobProcess(directory, ["sh", "-c", script], options.pop("env", env()), **options)
    await job.start()
    return job


async def outcome_of(directory: Path, script: str, **options):
    job = await run(directory, script, **options)
    return await asyncio.wait_for(job.wait(), BOUND)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("script", "completed", "kind", "error"),
    [
        ("exit 0", True, None, None),
        ("exit 75", False, "transient", "exited with status 75"),
        ("exit 3", False, "permanent", "exited with status 3"),
        ("kill -SEGV $$", False, "permanent", "killed by signal SIGSEGV"),
    ],
)
async def test_the_exit_status_maps_to_the_outcome(tmp_path, script, completed, kind, error):
    outcome = await outcome_of(tmp_path / "a1", script)
    assert (outcome.completed, outcome.kind, outcome.error) == (completed, kind, error)
    assert outcome.elapsed_ms >= 0


@pytest.mark.asyncio
async def test_a_command_that_is_not_found_is_permanent_and_says_so(tmp_path):
    job = JobProcess(
        tmp_path / "a1", ["no-such-command-here"], env(), timeout_secs=None, kill_grace=GRACE
    )
    await job.start()
    outcome = await asyncio.wait_for(job.wait(), BOUND)
    assert job.pid is None
    assert (outcome.completed, outcome.kind) == (False, "permanent")
    assert outcome.error == "command not found: no-such-command-here"
    assert outcome.log_tail == ""


@pytest.mark.asyncio
async def test_a_command_that_is_not_executable_is_permanent_and_says_so(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho never\n")
    script.chmod(0o644)
    job = JobProcess(tmp_path / "a1", [str(script)], env(), timeout_secs=None, kill_grace=GRACE)
    await job.start()
    outcome = await asyncio.wait_for(job.wait(), BOUND)
    assert (outcome.kind, outcome.error) == ("permanent", f"not executable: {script}")


@pytest.mark.asyncio
async def test_a_directory_that_cannot_be_made_is_permanent_and_says_so(tmp_path):
    (tmp_path / "workdir").write_text("a file where the workdir should be")
    outcome = await outcome_of(tmp_path / "workdir" / "a1", "exit 0")
    assert outcome.kind == "permanent"
    assert outcome.error.startswith(f"cannot make {tmp_path / 'workdir' / 'a1'}: ")


@pytest.mark.asyncio
async def test_the_job_runs_in_its_fresh_directory_with_exactly_its_environment(tmp_path):
    directory = tmp_path / "a1"
    directory.mkdir()
    (directory / "stale").write_text("from an earlier run")
    script = (
        "pwd > where; env > environment; readlink /proc/$$/fd/0 > stdin; ls > listing;"
        " echo out; echo err >&2"
    )
    outcome = await outcome_of(directory, script, env=env(GREETING="hello world"))
    assert outcome.completed
    assert (directory / "where").read_text().strip() == str(directory)
    variables = (directory / "environment").read_text().splitlines()
    assert "GREETING=hello world" in variables
    assert "GRADIENT_ASSIGNMENT_ID=a1" in variables
    assert not any(line.startswith("PYTEST_CURRENT_TEST=") for line in variables)
    assert (directory / "stdin").read_text().strip() == "/dev/null"
    assert "stale" not in (directory / "listing").read_text().split()
    assert (directory / OUTPUT_LOG).read_text() == "out\nerr\n"
    assert outcome.log_tail == "out\nerr\n"
    assert not (directory / GROUP_RECORD).exists()


@pytest.mark.asyncio
async def test_the_log_tail_is_the_last_64_kib_of_the_output_without_invalid_bytes_or_nul(
    tmp_path,
):
    script = r"head -c 100000 /dev/zero | tr '\000' a; printf '\377\000END'; exit 1"
    outcome = await outcome_of(tmp_path / "a1", script)
    assert outcome.kind == "permanent"
    assert (tmp_path / "a1" / OUTPUT_LOG).stat().st_size == 100005
    assert len(outcome.log_tail.encode()) <= MAX_LOG_TAIL_BYTES
    assert outcome.log_tail.endswith("a\ufffd\ufffdEND")
    assert outcome.log_tail.startswith("aaa")
    assert "\0" not in outcome.log_tail


@pytest.mark.asyncio
async def test_a_grandchild_the_job_left_behind_is_killed_when_its_first_process_exits(
    tmp_path, strays
):
    directory = tmp_path / "a1"
    outcome = await outcome_of(directory, "sleep 60 & echo $! > grandchild; exit 0")
    grandchild = int((directory / "grandchild").read_text())
    strays.append(grandchild)
    assert outcome.completed
    await eventually(lambda: not alive(grandchild))


@pytest.mark.asyncio
async def test_a_timeout_ends_a_process_that_ignores_sigterm_with_sigkill_after_the_grace(
    tmp_path,
):
    job = await run(tmp_path / "a1", "trap '' TERM; echo started; sleep 30", timeout_secs=1)
    await eventually(lambda: not alive(job.pid))  # whether or not anyone waits yet
    outcome = await asyncio.wait_for(job.wait(), BOUND)
    assert (outcome.completed, outcome.kind) == (False, "timeout")
    assert outcome.error == "timed out after 1 s"
    assert outcome.elapsed_ms >= (1 + GRACE) * 1000
    assert outcome.log_tail == "started\n"
    assert not alive(job.pid)


@pytest.mark.asyncio
async def test_an_abort_sends_sigterm_first_and_sigkill_after_the_grace(tmp_path):
    directory = tmp_path / "a1"
    script = "trap 'echo terminated > term' TERM; echo ready > ready; while :; do sleep 0.05; done"
    job = await run(directory, script)
    await eventually(lambda: (directory / "ready").exists())
    aborted_at = time.monotonic()
    await job.abort("the cluster was aborted")
    outcome = await asyncio.wait_for(job.wait(), BOUND)
    assert (outcome.completed, outcome.kind) == (False, "aborted")
    assert outcome.error == "the cluster was aborted"
    assert (directory / "term").read_text() == "terminated\n"  # the trap ran: SIGTERM came
    assert time.monotonic() - aborted_at >= GRACE  # the loop went on until SIGKILL
    assert not alive(job.pid)


@pytest.mark.asyncio
async def test_a_job_that_ends_on_sigterm_is_not_kept_for_the_grace(tmp_path):
    job = await run(tmp_path / "a1", "sleep 60", kill_grace=BOUND)
    aborted_at = time.monotonic()
    await job.abort("worker draining")
    outcome = await asyncio.wait_for(job.wait(), BOUND)
    assert (outcome.kind, outcome.error) == ("aborted", "worker draining")
    assert time.monotonic() - aborted_at < BOUND / 2


@pytest.mark.asyncio
async def test_an_abort_is_idempotent_and_changes_nothing_once_the_job_has_ended(tmp_path):
    job = await run(tmp_path / "a1", "exit 3")
    first = await asyncio.wait_for(job.wait(), BOUND)
    await job.abort("too late")
    await job.abort("too late again")
    assert first.error == "exited with status 3"
    assert (await job.wait()).error == "exited with status 3"

    early = JobProcess(tmp_path / "a2", ["sleep", "60"], env(), timeout_secs=None, kill_grace=1)
    await early.abort("aborted before it ran")
    await early.abort("a second reason")
    await early.start()
    outcome = await asyncio.wait_for(early.wait(), BOUND)
    assert early.pid is None
    assert (outcome.kind, outcome.error) == ("aborted", "aborted before it ran")


async def start_agent(directory: Path, script: str, assignment_id: str, spawn: str = "setpriv"):
    """A stand-in agent process running one job; returns it and the job's pid."""
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        AGENT,
        str(directory),
        "sh",
        "-c",
        script,
        cwd=ROOT,
        env={**os.environ, "GRADIENT_ASSIGNMENT_ID": assignment_id, "SPAWN": spawn},
        stdout=asyncio.subprocess.PIPE,
    )
    line = await asyncio.wait_for(agent.stdout.readline(), BOUND)
    return agent, int(line)


@pytest.mark.asyncio
@pytest.mark.parametrize("spawn", ["setpriv", "preexec"])
async def test_the_jobs_first_process_dies_with_its_agent_even_by_sigkill(tmp_path, strays, spawn):
    agent, pid = await start_agent(tmp_path / "a1", "exec sleep 60", "a1", spawn)
    strays.append(pid)
    assert alive(pid)
    agent.kill()
    await asyncio.wait_for(agent.wait(), BOUND)
    await eventually(lambda: not alive(pid))


@pytest.mark.asyncio
async def test_end_leftovers_ends_the_group_a_killed_agent_left_and_nothing_else(tmp_path, strays):
    workdir = tmp_path / "workdir"
    agent, leader = await start_agent(workdir / "a1", "sleep 60 & echo $! > grandchild; wait", "a1")
    strays.append(leader)
    await eventually(lambda: (workdir / "a1" / "grandchild").exists())
    grandchild = int((workdir / "a1" / "grandchild").read_text())
    strays.append(grandchild)
    # An unrelated process that took the pid of a leader a stale record names, started later.
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    strays.append(unrelated.pid)
    reused = workdir / "reused"
    reused.mkdir()
    record = json.loads((workdir / "a1" / GROUP_RECORD).read_text())
    stale = {
        **record,
        "pgid": unrelated.pid,
        "start_time": record["start_time"] - 100,
        "marker": "GRADIENT_ASSIGNMENT_ID=reused",
    }
    (reused / GROUP_RECORD).write_text(json.dumps(stale))

    agent.kill()
    await asyncio.wait_for(agent.wait(), BOUND)
    await eventually(lambda: not alive(leader))  # the parent-death signal
    assert alive(grandchild)  # a grandchild has none: only end_leftovers ends it

    lines = end_leftovers(workdir)

    await eventually(lambda: not alive(grandchild))
    assert alive(unrelated.pid)
    assert lines == [
        f"process group {leader} left in {workdir / 'a1'}: ended 1 process",
        f"process group {unrelated.pid} left in {reused}: had already ended",
    ]
    assert not list(workdir.glob(f"*/{GROUP_RECORD}"))
    assert end_leftovers(workdir) == []
    unrelated.kill()
    unrelated.wait(BOUND)


@pytest.mark.asyncio
async def test_end_leftovers_ends_a_whole_group_whose_leader_lives_even_unmarked_members(
    tmp_path, strays
):
    directory = tmp_path / "workdir" / "a1"
    # `env -i`: a member without the job's marker, found through its living leader's group.
    job = await run(directory, "env -i sleep 60 & echo $! > unmarked; sleep 60")
    strays.append(job.pid)
    pid_file = directory / "unmarked"
    # The shell creates the file before echo writes the pid and its newline.
    await eventually(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"))
    unmarked = int(pid_file.read_text())
    strays.append(unmarked)

    lines = end_leftovers(tmp_path / "workdir")

    outcome = await asyncio.wait_for(job.wait(), BOUND)
    assert outcome.error == "killed by signal SIGKILL"
    await eventually(lambda: not alive(unmarked))
    assert lines == [f"process group {job.pid} left in {directory}: ended 3 processes"]


def test_log_tail_cuts_at_a_character_and_stays_within_64_kib(tmp_path):
    text = tmp_path / "text"
    text.write_bytes("é".encode() * 40_000)  # 80,000 bytes: the cut falls inside one
    assert log_tail(text) == "é" * (MAX_LOG_TAIL_BYTES // 2)

    invalid = tmp_path / "invalid"
    invalid.write_bytes(b"\xff" * MAX_LOG_TAIL_BYTES)  # each becomes a 3-byte U+FFFD
    tail = log_tail(invalid)
    assert set(tail) == {"\ufffd"}
    assert len(tail.encode()) <= MAX_LOG_TAIL_BYTES

    assert log_tail(tmp_path / "missing") == ""


def test_log_tail_reads_only_the_end_of_a_huge_output(tmp_path):
    huge = tmp_path / "huge"
    with huge.open("wb") as output:
        output.truncate(16 * 2**30)  # sparse: reading it all would take minutes
        output.seek(0, os.SEEK_END)
        output.write(b"the end\n")
    started = time.monotonic()
    tail = log_tail(huge)
    assert tail.endswith("the end\n")
    assert "\0" not in tail  # the sparse start reads as NUL
    assert MAX_LOG_TAIL_BYTES - 2 <= len(tail.encode()) <= MAX_LOG_TAIL_BYTES
    assert time.monotonic() - started < 1


def test_prune_keeps_the_newest_finished_jobs_and_every_running_one(tmp_path):
    for age, name in enumerate(["j4", "j3", "j2", "j1", "j0", "running"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / OUTPUT_LOG).write_text(name)
        if name == "running":
            (tmp_path / name / GROUP_RECORD).write_text("{}")
        then = time.time() - 60 * (age + 1)
        os.utime(tmp_path / name, (then, then))
    (tmp_path / "agent.log").write_text("not a job")

    prune(tmp_path, keep=2)

    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "agent.log",
        "j3",
        "j4",
        "running",
    ]
    prune(tmp_path, keep=0)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["agent.log", "running"]
    with pytest.raises(ValueError, match="keep must be 0 or more"):
        prune(tmp_path, keep=-1)
