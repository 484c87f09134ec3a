"""Distributed tests run by real `gradient-worker` agents: daphne, Celery, PostgreSQL and Redis,
the agents as processes of their own, and their members as real processes."""

import asyncio
import json
import signal
import sys
import time

import pytest

from clusters.history import describe_cluster
from clusters.models import ClusterJob
from gradient.jobs.models import DispatchedJob, Project
from tests.commands import run
from tests.e2e.agents import agents, finished, gone, pids_in, seats
from tests.e2e.conftest import ROOT, VENV_BIN
from tests.e2e.fleet import q, until

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

PY = sys.executable
PING_PONG = str(ROOT / "examples" / "ping_pong.py")
KILL_GRACE = 1.0  # tests.e2e.agents starts every agent with --kill-grace 1


async def submit(tmp, members, **fields) -> int:
    """The cluster as submit_cluster --file takes it; its id."""
    path = tmp / f"cluster-{len(list(tmp.glob('cluster-*.json')))}.json"
    path.write_text(json.dumps({"project": "e2e", **fields, "members": members}))

    def create():
        Project.objects.get_or_create(name="e2e")
        return run("submit_cluster", "--file", str(path))["cluster"]

    return await q(create)


def reported_output(cluster_id: int, members: int) -> list | None:
    """The cluster's seats once each of its members has reported its output."""
    rows = seats(cluster_id)
    return rows if len(rows) == members and all(r.log_tail for r in rows) else None


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def history(cluster_id):
    return describe_cluster(ClusterJob.objects.get(pk=cluster_id))["history"]


async def manage(process_env, *args) -> dict:
    """An operator command in a process of its own, on the stack's Redis."""
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "python"),
        "manage.py",
        *args,
        cwd=str(ROOT),
        env=process_env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    return json.loads(out)


async def test_a_server_and_a_client_member_find_each_other_wait_for_a_signal_and_talk(
    stack, tmp_path
):
    async with agents(stack, tmp_path, {"a": {"zone": "a"}, "b": {"zone": "b"}}):
        cluster = await submit(
            tmp_path,
            [
                {"role": "server", "kind": "build", "command": [PY, PING_PONG]},
                {
                    "role": "client",
                    "kind": "build",
                    "command": [PY, PING_PONG],
                    "env": {"PING_PONG_QUESTION": "hello"},
                },
            ],
        )
        assert await until(lambda: finished(cluster), timeout=60) == "Completed"
        [attempt] = await q(lambda: history(cluster))
        tails = {
            seat["role"]: (await q(lambda s=seat: run("show_log", s["assignment_id"])))
            for seat in attempt["seats"]
        }
    assert {seat["worker"] for seat in attempt["seats"]} == {"a", "b"}
    assert "server: answered 'hello'" in tails["server"]["log_tail"]
    assert "client: the server answered 'pong hello'" in tails["client"]["log_tail"]
    assert {t["outcome"] for t in tails.values()} == {"Completed"}


async def test_abort_cluster_ends_every_member_process_within_the_kill_grace(
    stack, tmp_path, process_env
):
    pids = tmp_path / "pids"
    pids.mkdir()
    # A member that notes its SIGTERM and goes on, with a child that ignores SIGTERM: only the
    # SIGKILL after the grace ends them, and it must reach the whole process group.
    stubborn = sh(
        f"(trap '' TERM; exec sleep 600) & echo $! > {pids}/$GRADIENT_ROLE-child.pid;"
        f" echo $$ > {pids}/$GRADIENT_ROLE.pid; echo running as $GRADIENT_ROLE;"
        f" trap 'date +%s.%N > {pids}/$GRADIENT_ROLE.term' TERM;"
        " while :; do sleep 0.05; done"
    )
    async with agents(stack, tmp_path, {"a": {}, "b": {}}) as running:
        cluster = await submit(
            tmp_path,
            [
                {"role": "server", "kind": "build", "command": stubborn},
                {"role": "client", "kind": "build", "command": stubborn},
            ],
        )
        members = await pids_in(pids, 4)
        answer = await manage(process_env, "abort_cluster", str(cluster), "--reason", "stop")
        await gone(members, timeout=KILL_GRACE + 5)
        ended = time.time()
        assert answer == {"cluster": cluster, "status": "Aborted"}
        terms = [float(f.read_text()) for f in pids.glob("*.term")]
        assert len(terms) == 2, "every member got SIGTERM first"
        assert ended - max(terms) >= KILL_GRACE * 0.8 and ended - min(terms) <= KILL_GRACE + 3
        # The members' reports come after the verdict, and still leave their output.
        rows = await until(lambda: reported_output(cluster, 2))
        assert sorted(r.log_tail.splitlines()[0] for r in rows) == [
            "running as client",
            "running as server",
        ]
        assert all(agent.proc.returncode is None for agent in running.values())


async def test_a_member_failing_makes_the_cluster_retry_and_the_retry_completes(stack, tmp_path):
    marker = tmp_path / "failed-once"
    flaky = sh(f"if [ -e {marker} ]; then echo second try; exit 0; fi; touch {marker}; exit 75")
    async with agents(stack, tmp_path, {"a": {}, "b": {}}):
        cluster = await submit(
            tmp_path,
            [
                {"role": "flaky", "kind": "build", "command": flaky},
                {"role": "steady", "kind": "build", "command": sh("sleep 0.3")},
            ],
            retry_budget=1,
        )
        assert await until(lambda: finished(cluster), timeout=60) == "Completed"
        attempts = await q(lambda: history(cluster))
    started = [a for a in attempts if a["started_at"] is not None]
    assert [a["outcome"] for a in started] == ["Failed", "Succeeded"]
    [first_flaky] = [s for s in started[0]["seats"] if s["role"] == "flaky"]
    row = await q(lambda: DispatchedJob.objects.get(pk=first_flaky["assignment_id"]))
    assert row.failure_kind == "transient"


async def test_a_job_past_its_timeout_is_ended_and_reported_as_timed_out(stack, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    command = json.dumps(sh(f"echo $$ > {pids}/single.pid; exec sleep 600"))

    def create():
        Project.objects.get_or_create(name="e2e")
        args = ("--project", "e2e", "--kind", "build", "--command", command)
        return run("submit_job", *args, "--timeout-secs", "1")["job_ids"][0]

    async with agents(stack, tmp_path, {"a": {}}):
        job = await q(create)
        [pid] = await pids_in(pids, 1)
        await gone([pid], timeout=1 + KILL_GRACE + 5)
        row = await until(
            lambda: DispatchedJob.objects.filter(job_id=job, finished_at__isnull=False).first()
        )
    assert row.outcome == "Failed" and row.failure_kind == "timeout"


async def test_an_agent_killed_with_sigkill_leaves_no_member_behind_and_the_retry_goes_elsewhere(
    stack, tmp_path
):
    pids = tmp_path / "pids"
    pids.mkdir()
    first_try = tmp_path / "first-try"
    # The first try runs until its agent dies; the retry completes at once.
    member = sh(
        f"if [ -e {first_try} ]; then exit 0; fi;"
        f" echo $$ > {pids}/$GRADIENT_WORKER.pid; exec sleep 600"
    )
    async with agents(stack, tmp_path, {"a": {}, "b": {}, "c": {}}) as running:
        cluster = await submit(
            tmp_path,
            [
                {"role": "server", "kind": "build", "command": member},
                {"role": "client", "kind": "build", "command": member},
            ],
            retry_budget=1,
        )
        await pids_in(pids, 2)
        first_try.touch()
        [victim, other] = [running[f.stem] for f in sorted(pids.glob("*.pid"))]
        member_pid = int((pids / f"{victim.name}.pid").read_text())
        victim.signal(signal.SIGKILL)
        assert await victim.exit_status() == -signal.SIGKILL
        # Its member dies with it (the parent-death signal), before the server knows a thing.
        await gone([member_pid], timeout=5)
        assert await until(lambda: finished(cluster), timeout=60) == "Completed"
        attempts = await q(lambda: history(cluster))
    started = [a for a in attempts if a["started_at"] is not None]
    assert len(started) == 2, attempts
    assert victim.name not in {seat["worker"] for seat in started[1]["seats"]}
    assert other.name in {seat["worker"] for seat in started[0]["seats"]}
