"""The agent's runs (protocol.md, "A run", "Outcome"), a real gradient-worker against a fake
server: commands run as processes, members only after StartCluster and told their peers,
aborts end the process, and every report carries the end of the output."""

import asyncio
import json
import os
from pathlib import Path

import pytest

from gradient.wire import protocol as p
from tests.agent_harness import AGENT
from tests.agent_session import WORKER, connected, job
from tests.fake_server import ATT1, build, hold, uuid

pytestmark = pytest.mark.asyncio


def group_alive(pgid: int) -> list[int]:
    """The processes of a group that still run (a zombie is dead, reaped or not)."""
    alive = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = open(f"/proc/{entry.name}/stat").read()  # noqa: SIM115
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive.append(int(entry.name))
    return alive


async def eventually(condition, within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not condition():
            await asyncio.sleep(0.02)


def roster(*endpoints: str | None) -> p.StartCluster:
    entries = [
        p.RosterEntry(role="db", index=0, worker=WORKER, zone=None, endpoint=endpoints[0]),
        p.RosterEntry(role="web", index=1, worker="agent-2", zone=None, endpoint=endpoints[1]),
    ]
    return p.StartCluster(attempt=ATT1, roster=entries)


async def test_a_command_runs_in_its_directory_and_completes_with_the_end_of_its_output(
    tmp_path,
):
    script = 'echo "$GRADIENT_JOB_ID $GRADIENT_WORKER $GRADIENT_ENDPOINT $EXTRA"; pwd'
    async with connected(tmp_path, "--endpoint", "10.0.0.9:7000") as (agent, session, _):
        await session.send(job(["sh", "-c", script], env={"EXTRA": "yes"}))
        assert (await session.expect(p.AssignJobResponse)).accepted
        done = await session.expect(p.JobCompleted)
        directory = tmp_path / "work" / uuid(201)
        assert done.log_tail == f"{build(1)} {WORKER} 10.0.0.9:7000 yes\n{directory}\n"
        started = await agent.wait_event("started", job_id=build(1))
        assert started["pid"] > 0 and started["directory"] == str(directory)
        completed = await agent.wait_event("completed", job_id=build(1))
        assert completed["elapsed_ms"] == done.elapsed_ms
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")


async def test_an_exit_status_is_a_failure_of_its_kind_with_the_output(tmp_path):
    async with connected(tmp_path) as (agent, session, _):
        await session.send(job(["sh", "-c", "echo broken; exit 75"]))
        await session.expect(p.AssignJobResponse)
        failed = await session.expect(p.JobFailed)
        assert (failed.kind, failed.error) == ("transient", "exited with status 75")
        assert failed.log_tail == "broken\n"
        logged = await agent.wait_event("failed", job_id=build(1))
        assert (logged["kind"], logged["error"]) == ("transient", "exited with status 75")


async def test_a_job_without_a_command_fails_for_good_and_says_so(tmp_path):
    async with connected(tmp_path) as (_, session, _):
        await session.send(job(None))
        assert (await session.expect(p.AssignJobResponse)).accepted
        failed = await session.expect(p.JobFailed)
        assert (failed.kind, failed.error) == ("permanent", "the job has no command")


async def test_a_member_runs_after_start_cluster_knowing_its_place_and_its_peers(tmp_path):
    script = (
        'echo "$GRADIENT_ATTEMPT $GRADIENT_ROLE $GRADIENT_INDEX"'
        ' "$GRADIENT_PEER_DB_0" "$GRADIENT_PEER_WEB_1";'
        ' cat "$GRADIENT_HOSTFILE"; cat "$GRADIENT_ROSTER_FILE";'
        ' test -S "$GRADIENT_SIGNAL_SOCKET" && echo socket'
    )
    async with connected(tmp_path) as (agent, session, _):
        await session.send(job(["sh", "-c", script], cluster=hold(role="db", index=0)))
        assert (await session.expect(p.AssignJobResponse)).accepted
        await agent.wait_event("held", job_id=build(1))
        assert not agent.named("started")  # held: nothing runs before StartCluster
        await session.send(roster("10.0.0.1:5432", None))
        done = await session.expect(p.JobCompleted)
        received = await agent.wait_event("start_cluster", job_id=build(1))
        started = await agent.wait_event("started", job_id=build(1))
    assert received["attempt"] == ATT1 and received["time"] <= started["time"]
    lines = done.log_tail.splitlines()
    assert lines[0] == f"{ATT1} db 0 10.0.0.1:5432 "
    assert lines[1:3] == ["10.0.0.1:5432", "agent-2"]
    assert [entry["role"] for entry in json.loads(lines[3])] == ["db", "web"]
    assert lines[4] == "socket"


async def test_a_member_signals_the_others_and_reads_what_they_sent(tmp_path):
    script = f"{AGENT} signal send '{{\"ready\": true}}' && {AGENT} signal wait --timeout 10"
    async with connected(tmp_path) as (_, session, _):
        await session.send(job(["sh", "-c", script], cluster=hold(role="db", index=0)))
        await session.expect(p.AssignJobResponse)
        await session.send(roster(None, None))
        sent = await session.expect(p.ClusterSignal)
        assert (sent.attempt, sent.to, sent.payload) == (ATT1, None, {"ready": True})
        forwarded = {"attempt": ATT1, "from": {"role": "web", "index": 1}, "payload": [1, 2]}
        await session.send({"type": "ClusterSignal", **forwarded})
        done = await session.expect(p.JobCompleted)
        assert done.log_tail == "[1, 2]\n"


async def test_an_abort_ends_the_process_group_and_is_reported_as_aborted(tmp_path):
    async with connected(tmp_path, "--kill-grace", "5") as (agent, session, _):
        await session.send(job(["sh", "-c", "echo up; sleep 60 & wait"]))
        await session.expect(p.AssignJobResponse)
        started = await agent.wait_event("started", job_id=build(1))
        output = Path(started["directory"]) / "output.log"
        await eventually(lambda: output.read_text() == "up\n")  # the command itself runs
        await session.send(p.AbortJob(job_id=build(1), reason="canceled"))
        failed = await session.expect(p.JobFailed)
        assert (failed.kind, failed.error) == ("aborted", "job aborted: canceled")
        assert failed.log_tail == "up\n"
        logged = await agent.wait_event("failed", job_id=build(1))
        assert logged["elapsed_ms"] < 5000  # sh ends on SIGTERM: no wait for the grace
        await eventually(lambda: not group_alive(started["pid"]))  # SIGKILLed: dying
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")


async def test_abort_cluster_ends_a_running_member_and_drops_a_held_one(tmp_path):
    async with connected(tmp_path, builds=2) as (agent, session, _):
        await session.send(job(["sleep", "60"], cluster=hold(role="db", index=0)))
        await session.send(job(["true"], n=2, cluster=hold(attempt=uuid(102))))
        await session.expect(p.AssignJobResponse)
        await session.expect(p.AssignJobResponse)
        await session.send(roster(None, None))
        await agent.wait_event("started", job_id=build(1))
        await session.send(p.AbortCluster(attempt=uuid(102), reason="prepare failed"))
        assert await session.expect(p.RequestJob) == p.RequestJob(kind="build")  # no report
        await session.send(p.AbortCluster(attempt=ATT1, reason="member failed"))
        failed = await session.expect(p.JobFailed)
        assert (failed.job_id, failed.kind) == (build(1), "aborted")
        assert failed.error == "cluster aborted: member failed"


async def test_a_timeout_is_reported_as_such(tmp_path):
    async with connected(tmp_path, "--kill-grace", "1") as (_, session, _):
        await session.send(job(["sleep", "60"], timeout_secs=1))
        await session.expect(p.AssignJobResponse)
        failed = await session.expect(p.JobFailed, timeout=10)
        assert (failed.kind, failed.error) == ("timeout", "timed out after 1 s")


async def test_a_held_member_whose_start_never_comes_is_given_up(tmp_path):
    async with connected(tmp_path) as (_, session, _):
        await session.send(job(["true"], cluster=hold(hold_secs=1)))
        await session.expect(p.AssignJobResponse)
        failed = await session.expect(p.JobFailed, timeout=5)
        assert (failed.kind, failed.error) == ("aborted", "cluster start timed out")


async def test_old_job_directories_are_pruned_and_the_newest_kept(tmp_path):
    async with connected(tmp_path) as (_, session, _):
        work = tmp_path / "work"
        for n in range(25):  # finished jobs of an earlier run
            (work / f"old-{n:02}").mkdir()
            os.utime(work / f"old-{n:02}", (n, n))
        await session.send(job(["true"]))
        await session.expect(p.AssignJobResponse)
        await session.expect(p.JobCompleted)
        await session.expect(p.RequestJob)
    kept = sorted(path.name for path in work.iterdir())
    assert uuid(201) in kept and len(kept) == 21  # 20 + the slot's
    assert "old-00" not in kept and "old-24" in kept
