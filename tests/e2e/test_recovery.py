"""Recovery end to end: a member's worker process killed mid-attempt, and the operator's abort."""

import asyncio
import json
import os
import signal

import pytest

from clusters.models import ClusterAttempt, ClusterJob
from gradient.jobs.models import DispatchedJob
from tests.e2e.conftest import ROOT, VENV_BIN
from tests.e2e.fleet import q, until
from tests.e2e.test_cluster_dispatch import history, submit

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


async def worker_process(name, url, env, log_dir, job_secs="6-6"):
    """One reference worker in a process of its own (so it can be killed), named NAME-0."""
    log = open(log_dir / f"fleet-{name}.log", "w")  # noqa: SIM115 - closed by the caller
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "python"),
        "manage.py",
        "simulate_workers",
        "--count",
        "1",
        "--prefix",
        name,
        "--job-secs",
        job_secs,
        "--url",
        url,
        cwd=str(ROOT),
        env=env,
        stdout=log,
        stderr=log,
    )
    return proc, log


async def test_a_killed_members_worker_fails_the_attempt_and_the_retry_avoids_it(
    stack, process_env, tmp_path
):
    env = {**process_env, "GRADIENT_WORKER_TIMEOUT_SECS": "120"}
    # Four workers: after the kill three are left for two seats, so the retry could pick the
    # killed one's name only if the server seated a gone worker.
    names = ("w", "x", "y", "z")
    fleet = {n: await worker_process(n, stack, env, tmp_path) for n in names}
    try:
        from workers.models import Worker

        await until(
            lambda: Worker.objects.filter(channel_name__isnull=False).count() == len(names),
            timeout=30,
        )
        cluster = await submit("server:eval", "client:build", retry_budget=2)
        first = await until(
            lambda: ClusterAttempt.objects.filter(
                cluster_job_id=cluster, started_at__isnull=False
            ).first(),
            timeout=30,
        )
        seated = await q(
            lambda: list(
                DispatchedJob.objects.filter(cluster_attempt=first).values_list(
                    "worker__name", flat=True
                )
            )
        )
        victim = seated[0].removesuffix("-0")
        os.kill(fleet[victim][0].pid, signal.SIGKILL)

        status = await until(
            lambda: ClusterJob.objects.filter(pk=cluster, status="Completed").exists(),
            timeout=60,
        )
        assert status
        attempts = await q(lambda: history(cluster))
        # Exactly two tries of the members. A PrepareFailed attempt never started (a seat
        # that went busy or did not answer in time) is no try and may come in between.
        started = [a for a in attempts if a["started_at"] is not None]
        assert all(a["outcome"] == "PrepareFailed" for a in attempts if a not in started)
        assert len(started) == 2, attempts
        assert started[0]["id"] == str(first.pk)
        assert started[0]["outcome"] in ("Failed", "Aborted")
        assert await q(
            lambda: (
                not DispatchedJob.objects.filter(
                    cluster_attempt=first, finished_at__isnull=True
                ).exists()
            )
        )
        second = started[1]
        assert second["outcome"] == "Succeeded" and second == attempts[-1]
        workers = [s["worker"] for s in second["seats"]]
        assert len(set(workers)) == 2 and f"{victim}-0" not in workers
    finally:
        for proc, _ in fleet.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc, log in fleet.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
            log.close()


async def test_abort_cluster_on_a_running_cluster_ends_it_aborted_with_every_worker_told(
    stack, process_env
):
    from tests.e2e.fleet import fleet

    slow = {"job_secs": (20.0, 20.0)}
    async with fleet(stack, {"p": slow, "q": slow}) as workers:
        cluster = await submit("server:eval", "client:build")
        for w in workers.values():
            await w.wait_event("started", timeout=30)
        proc = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "python"),
            "manage.py",
            "abort_cluster",
            str(cluster),
            "--reason",
            "operator says stop",
            cwd=str(ROOT),
            env=process_env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert json.loads(out) == {"cluster": cluster, "status": "Aborted"}
        for w in workers.values():
            failed = await w.wait_event("failed", timeout=10)
            assert failed["kind"] == "aborted" and "operator says stop" in failed["error"]
        assert await q(lambda: ClusterJob.objects.get(pk=cluster).status) == "Aborted"
        [attempt] = await q(lambda: history(cluster))
        assert attempt["outcome"] == "Aborted"
        # The workers' own JobFailed{aborted} reports arrive after the verdict: no errors.
        await asyncio.sleep(0.5)
        assert all(not w.errors for w in workers.values()), [w.errors for w in workers.values()]
