"""What a real `gradient-worker` does on its machine beyond running members: drain, a server
restart, scores from its store and cache, and TLS."""

import json
import signal
import subprocess

import pytest

from clusters.history import describe_cluster
from clusters.models import ClusterJob
from gradient.jobs.models import DispatchedJob, Project
from tests.commands import run
from tests.e2e.agents import Agent, agents, connected, finished, gone, make_workers, pids_in
from tests.e2e.conftest import LAUNCHERS, VENV_BIN, free_port, wait_for_port
from tests.e2e.fleet import q, until
from tests.e2e.test_agent_clusters import sh, submit
from workers.models import Worker

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


def seat_of(cluster_id) -> dict:
    [attempt, *_] = describe_cluster(ClusterJob.objects.get(pk=cluster_id))["history"]
    return {seat["role"]: seat for seat in attempt["seats"]}


async def test_a_drained_agent_lets_its_running_member_finish_and_exits_0(stack, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    member = sh(f"echo $$ > {pids}/$GRADIENT_WORKER.pid; sleep 2; echo finished")
    async with agents(stack, tmp_path, {"a": {}, "b": {}}) as running:
        cluster = await submit(
            tmp_path,
            [
                {"role": "server", "kind": "build", "command": member},
                {"role": "client", "kind": "build", "command": member},
            ],
        )
        await pids_in(pids, 2)
        running["a"].signal(signal.SIGTERM)
        assert await running["a"].exit_status(timeout=20) == 0
        assert await until(lambda: finished(cluster), timeout=30) == "Completed"
        seats = await q(lambda: seat_of(cluster))
    drained = next(s for s in seats.values() if s["worker"] == "a")
    log = await q(lambda: run("show_log", drained["assignment_id"]))
    assert log["outcome"] == "Completed" and "finished" in log["log_tail"]


async def test_members_go_on_while_daphne_restarts_and_their_reports_arrive_afterwards(
    processes, tmp_path
):
    port = free_port()
    url = f"ws://127.0.0.1:{port}/proto"
    first = processes.start("daphne-first", *LAUNCHERS["daphne"](port))
    wait_for_port(port, first)
    processes.celery()
    pids = tmp_path / "pids"
    pids.mkdir()
    release = tmp_path / "release"
    member = sh(
        f"echo $$ > {pids}/$GRADIENT_WORKER.pid;"
        f" while [ ! -e {release} ]; do sleep 0.05; done; echo reported later"
    )
    async with agents(url, tmp_path, {"a": {}, "b": {}}):
        cluster = await submit(
            tmp_path,
            [
                {"role": "server", "kind": "build", "command": member},
                {"role": "client", "kind": "build", "command": member},
            ],
        )
        members = await pids_in(pids, 2)
        first.send_signal(signal.SIGKILL)
        first.wait()
        release.touch()  # the members finish while no server listens
        await gone(members, timeout=10)
        second = processes.start("daphne-second", *LAUNCHERS["daphne"](port))
        wait_for_port(port, second)
        assert await until(lambda: finished(cluster), timeout=60) == "Completed"
        seats = await q(lambda: seat_of(cluster))
    for seat in seats.values():
        log = await q(lambda s=seat: run("show_log", s["assignment_id"]))
        assert log["outcome"] == "Completed" and "reported later" in log["log_tail"]


def store_and_cache(tmp, name: str, have: str, missing: str) -> tuple[str, ...]:
    """A store that has the path `have`, and a cache that knows the size of `missing`."""
    store, cache = tmp / f"store-{name}", tmp / f"cache-{name}"
    (store / have).mkdir(parents=True)
    cache.mkdir()
    digest = missing.split("-")[0]
    narinfo = f"StorePath: /nix/store/{missing}\nNarSize: 900000000\n"
    (cache / f"{digest}.narinfo").write_text(narinfo)
    return ("--store", str(store), "--cache", str(cache))


async def test_scores_from_a_store_and_a_cache_on_disk_seat_each_member_where_its_closure_is(
    stack, tmp_path
):
    x, y = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-x", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb-y"
    specs = {
        "a": {"args": store_and_cache(tmp_path, "a", have=y, missing=x)},
        "b": {"args": store_and_cache(tmp_path, "b", have=x, missing=y)},
    }
    async with agents(stack, tmp_path, specs):
        members = [
            {"role": f"needs-{p[-1]}", "kind": "build", "paths": [f"/nix/store/{p}"]}
            for p in (x, y)
        ]
        cluster = await submit(tmp_path, [{**m, "command": ["true"]} for m in members])
        assert await until(lambda: finished(cluster), timeout=30) == "Completed"
        seats = await q(lambda: seat_of(cluster))
    assert seats["needs-x"]["worker"] == "b" and seats["needs-y"]["worker"] == "a"
    sizes = await q(
        lambda: sorted(
            DispatchedJob.objects.filter(cluster_attempt__cluster_job_id=cluster).values_list(
                "missing_nar_size", flat=True
            )
        )
    )
    assert sizes == [0, 0]


def certificates(tmp) -> dict[str, str]:
    """A private authority and a certificate it signed for localhost and 127.0.0.1."""
    paths = {k: str(tmp / f"{k}.pem") for k in ("ca", "ca-key", "cert", "key")}
    ssl = ["openssl", "req", "-nodes", "-newkey", "rsa:2048", "-days", "2"]
    subprocess.run(
        [*ssl, "-x509", "-keyout", paths["ca-key"], "-out", paths["ca"], "-subj", "/CN=test CA"],
        check=True,
        capture_output=True,
    )
    csr = str(tmp / "cert.csr")
    subprocess.run(
        [*ssl, "-keyout", paths["key"], "-out", csr, "-subj", "/CN=localhost"],
        check=True,
        capture_output=True,
    )
    ext = tmp / "san.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    subprocess.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            paths["ca"],
            "-CAkey",
            paths["ca-key"],
            "-CAcreateserial",
            "-out",
            paths["cert"],
            "-days",
            "2",
            "-extfile",
            str(ext),
        ],
        check=True,
        capture_output=True,
    )
    return paths


async def test_an_agent_over_wss_runs_a_job_when_it_trusts_the_authority_and_exits_3_otherwise(
    processes, tmp_path
):
    pem = certificates(tmp_path)
    port = free_port()
    endpoint = f"ssl:{port}:interface=127.0.0.1:privateKey={pem['key']}:certKey={pem['cert']}"
    daphne = processes.start(
        "daphne-tls", str(VENV_BIN / "daphne"), "-e", endpoint, "gradient.asgi:application"
    )
    wait_for_port(port, daphne)
    url = f"wss://localhost:{port}/proto"
    await make_workers("trusting", "doubting")

    async with Agent("doubting", url, tmp_path) as doubting:
        assert await doubting.exit_status(timeout=20) == 3
        assert "certificate" in (await doubting.wait_event("fatal"))["reason"]
    # The handshake never reached the application, so the token was never sent.
    assert await q(lambda: Worker.objects.get(name="doubting").last_seen_at) is None

    trusting = await Agent("trusting", url, tmp_path, "--ca-file", pem["ca"]).__aenter__()
    try:
        await connected("trusting")
        command = json.dumps(sh("echo over tls"))

        def create():
            Project.objects.get_or_create(name="e2e")
            args = ("--project", "e2e", "--kind", "build", "--command", command)
            return run("submit_job", *args)["job_ids"][0]

        job = await q(create)
        row = await until(
            lambda: DispatchedJob.objects.filter(job_id=job, finished_at__isnull=False).first()
        )
    finally:
        await trusting.stop()
    assert row.outcome == "Completed" and "over tls" in row.log_tail
