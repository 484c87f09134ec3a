"""The operators' view in a real browser: headless Chromium (Debian's, driven by Playwright)
against a real daphne serving the admin, its CSS collected and served by WhiteNoise."""

import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob, DispatchedOutcome, EvaluationStatus
from tests.e2e.conftest import ROOT
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory, WorkerFactory
from workers.models import IdleSlot

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = ROOT / "test-artifacts"
PASSWORD = "a-long-enough-password"

from playwright import sync_api  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _chromium():
    # bin/setup installs Debian's chromium; a machine without it fails here, loudly.
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing: run bin/setup as root"


@pytest.fixture(scope="module")
def settings_module(tmp_path_factory) -> Path:
    """A settings module for daphne whose STATIC_ROOT holds the admin's collected files, so the
    test serves CSS as production does without writing to the tree's run/static."""
    where = tmp_path_factory.mktemp("admin-browser")
    static = where / "static"
    with override_settings(STATIC_ROOT=static):
        call_command("collectstatic", interactive=False, verbosity=0)
    (where / "admin_browser_settings.py").write_text(
        f"from gradient.settings import *  # noqa: F403\nSTATIC_ROOT = {str(static)!r}\n"
    )
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def server(processes, settings_module) -> str:
    """A real daphne: its HTTP origin, serving the admin under /admin/."""
    path = os.pathsep.join(filter(None, [str(settings_module), os.environ.get("PYTHONPATH")]))
    url = processes.daphne(DJANGO_SETTINGS_MODULE="admin_browser_settings", PYTHONPATH=path)
    return url.replace("ws://", "http://").removesuffix("/proto")


def seat(made, member, worker, outcome, **report):
    DispatchedJob.objects.create(
        kind=member.kind,
        job_id=member.job_key,
        worker=worker,
        project=member.cluster_job.project,
        dispatched_at=made.created_at,
        finished_at=made.finished_at,
        outcome=outcome,
        cluster_attempt=made,
        **report,
    )


# A failed client's output: long enough to scroll, and with markup that must stay text.
CLIENT_LOG = "".join(f"test {i} ... ok\n" for i in range(400)) + (
    "<script>window.injected = true</script>\nFAILED: connection refused\n"
)


def finished_cluster() -> tuple[ClusterJob, ClusterAttempt, ClusterAttempt]:
    """Prepared once and failed (a member rejected), then started and succeeded."""
    server = EvalMemberFactory(role="server", primary=True)
    cluster = server.cluster_job
    client = BuildMemberFactory(cluster_job=cluster, role="client")
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.COMPLETED, attempts=1)
    t0 = timezone.now() - timedelta(minutes=40)
    failed = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0,
        finished_at=t0 + timedelta(minutes=1),
        outcome=AttemptOutcome.PREPARE_FAILED,
    )
    done = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0 + timedelta(minutes=2),
        started_at=t0 + timedelta(minutes=3),
        finished_at=t0 + timedelta(minutes=30),
        outcome=AttemptOutcome.SUCCEEDED,
    )
    gpu1, gpu2 = WorkerFactory(name="gpu-1", zone="eu-1"), WorkerFactory(name="gpu-2", zone="eu-1")
    cpu1, cpu2 = WorkerFactory(name="cpu-1", zone="eu-2"), WorkerFactory(name="cpu-2", zone="eu-2")
    seat(failed, server, gpu1, DispatchedOutcome.ABANDONED)
    seat(
        failed,
        client,
        gpu2,
        DispatchedOutcome.FAILED,
        failure_kind="permanent",
        error="exit status 1",
        log_tail=CLIENT_LOG,
    )
    seat(done, server, cpu1, DispatchedOutcome.COMPLETED)
    seat(done, client, cpu2, DispatchedOutcome.COMPLETED)
    return cluster, failed, done


def waiting_cluster() -> ClusterJob:
    """Queued and in the book: one connected worker can seat the client, none the server."""
    cluster = ClusterFactory(same_zone=False)
    EvalMemberFactory(cluster_job=cluster, role="server", primary=True)
    BuildMemberFactory(cluster_job=cluster, role="client")
    worker = WorkerFactory(name="idle-1", zone="eu-1", channel_name="live")
    IdleSlot.objects.create(worker=worker, kind="build", recorded_at=timezone.now())
    WorkerFactory(name="busy-1", zone="eu-1", channel_name="live")  # connected, no idle slot
    return cluster


def test_an_operator_reads_a_cluster_page_and_aborts_a_waiting_cluster(server, django_user_model):
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    cluster, failed, done = finished_cluster()
    waiting = waiting_cluster()
    ARTIFACTS.mkdir(exist_ok=True)

    # Browser steps only: Django refuses ORM calls while Playwright's event loop is running.
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(10_000)
            expect = sync_api.expect

            # Log in through the form, landing on the cluster page.
            change = f"/admin/clusters/clusterjob/{cluster.pk}/change/"
            page.goto(f"{server}/admin/login/?next={change}")
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(server + change)
            # The admin's own CSS came from the collected static files.
            assert page.request.get(f"{server}/static/admin/css/base.css").ok

            # Both attempts, as bars in order on one axis, and the seats each took.
            bars = page.locator("g.attempt-bar")
            expect(bars).to_have_count(2)
            prepare_failed = page.locator('g.attempt-bar[data-outcome="PrepareFailed"] rect')
            succeeded = page.locator('g.attempt-bar[data-outcome="Succeeded"] rect')
            expect(prepare_failed).to_have_count(1)  # never started: no running part
            expect(succeeded).to_have_count(2)  # prepared, then ran
            first, second = prepare_failed.bounding_box(), succeeded.first.bounding_box()
            assert 0 < 5 * first["width"] < second["width"]  # 1 minute against 28
            assert first["x"] < second["x"] and first["y"] < second["y"]
            failed_row = page.locator(f'.attempt-row[data-attempt="{failed.pk}"]')
            done_row = page.locator(f'.attempt-row[data-attempt="{done.pk}"]')
            expect(failed_row.locator("li.seat")).to_have_count(2)
            expect(failed_row.locator('li.seat[data-seat="client/0"]')).to_contain_text(
                "client/0 on gpu-2 · zone eu-1 · Failed"
            )
            expect(done_row.locator('li.seat[data-seat="server/0"]')).to_contain_text(
                "server/0 on cpu-1 · zone eu-2 · Completed"
            )
            # How the failed seat ended, and its output in a box that scrolls, as text.
            ending = failed_row.locator('.seat-ending[data-seat="client/0"]')
            expect(ending).to_contain_text("client/0 Failed (permanent): exit status 1")
            log = ending.locator(".log-tail")
            expect(log).to_contain_text("<script>window.injected = true</script>")
            assert page.evaluate("window.injected") is None
            # It opens on its end: the last lines in the box, the first scrolled out above.
            seen = log.evaluate(
                """el => {
                    const box = el.getBoundingClientRect();
                    const text = el.firstElementChild.getBoundingClientRect();
                    return [el.scrollHeight > 2 * el.clientHeight, box.height,
                            Math.abs(text.bottom - box.bottom) < 2, text.top < box.top,
                            getComputedStyle(el).overflowY];
                }"""
            )
            assert seen[0] and seen[1] <= 400 and seen[2] and seen[3] and seen[4] == "auto", seen
            expect(page.locator("#cluster-members tr.member")).to_have_count(2)
            expect(page.locator("#cluster-explain")).to_have_count(0)  # it does not wait
            page.screenshot(path=str(ARTIFACTS / "cluster-page.png"), full_page=True)

            # The waiting cluster says why it waits, member by member.
            page.goto(f"{server}/admin/clusters/clusterjob/{waiting.pk}/change/")
            expect(page.locator(".explain-summary")).to_contain_text("no worker can seat server/0")
            expect(
                page.locator('#explain-members tr[data-member="client/0"] .candidates')
            ).to_have_text("idle-1")
            page.screenshot(path=str(ARTIFACTS / "cluster-waiting.png"), full_page=True)

            # Abort it through the list's action and its confirmation page.
            page.goto(f"{server}/admin/clusters/clusterjob/?status__exact=Queued")
            page.check(f'input[name="_selected_action"][value="{waiting.pk}"]')
            page.select_option("select[name=action]", "abort_selected")
            page.click("button[name=index]")
            expect(page.locator("#clusters-to-abort")).to_contain_text("will be aborted")
            page.fill("input[name=reason]", "maintenance window")
            page.click("input[type=submit][value='Yes, abort']")
            expect(page.locator("ul.messagelist")).to_contain_text(
                f"Aborted cluster(s) {waiting.pk}."
            )
            page.goto(f"{server}/admin/clusters/clusterjob/{waiting.pk}/change/")
            expect(page.locator(".fieldBox.field-status .readonly")).to_have_text("Aborted")
        finally:
            browser.close()

    waiting.refresh_from_db()
    assert waiting.status == ClusterStatus.ABORTED
    evaluation = waiting.members.get(role="server").evaluation
    assert evaluation.status == EvaluationStatus.ABORTED
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.COMPLETED  # only the selected one
