"""Worker health in the admin, in a real browser against a real daphne: the list and the page
show the quarantine and the blamed seats, and the release goes through a confirmation page."""

import pytest
from django.utils import timezone

from clusters import coordinator
from clusters.claim import claim_cluster
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import claim_for, make_cluster
from tests.e2e.test_admin_browser import (  # noqa: F401 - fixtures
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    PASSWORD,
    _chromium,
    server,
    settings_module,
    sync_api,
)
from tests.factories import WorkerFactory
from workers import health
from workers.models import Worker

pytestmark = pytest.mark.e2e


def quarantined_by_its_seats(name: str) -> Worker:
    """A worker whose three rejections in a row quarantined it, as the close decides."""
    flaky, partner = WorkerFactory(name=name, zone="eu-1"), WorkerFactory(name=f"{name}-peer")
    for _ in range(3):
        claim = claim_for(make_cluster(), [flaky, partner])
        assert claim_cluster(claim)
        row = DispatchedJob.objects.get(cluster_attempt_id=claim.attempt_id, worker=flaky)
        coordinator.member_rejected(flaky.pk, row.job_id, "flaky")
    flaky.refresh_from_db()
    assert health.is_quarantined(flaky, timezone.now())
    return flaky


def test_an_operator_sees_a_quarantined_worker_and_releases_it(server, django_user_model):  # noqa: F811
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    flaky = quarantined_by_its_seats("flaky-1")
    WorkerFactory(name="healthy-1")
    ARTIFACTS.mkdir(exist_ok=True)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(10_000)
            expect = sync_api.expect
            listing = "/admin/workers/worker/"
            page.goto(f"{server}/admin/login/?next={listing}")
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(server + listing)

            # The list names the quarantine, and filters on it.
            row = page.locator("#result_list tbody tr", has_text="flaky-1").first
            expect(row.locator(".quarantine")).to_contain_text(
                "3 blamed seats in a row, the last rejected since"
            )
            expect(row.locator('.quarantine[data-by="automatic"]')).to_contain_text("automatic")
            page.goto(f"{server}{listing}?health=quarantined")
            expect(page.locator("#result_list tbody tr")).to_have_count(1)
            expect(page.locator("#result_list tbody")).to_contain_text("flaky-1")

            # The page: the quarantine and the three blamed seats, newest first.
            page.goto(f"{server}{listing}{flaky.pk}/change/")
            expect(page.locator(".field-quarantine .readonly")).to_contain_text("by automatic")
            seats = page.locator("#recent-seats tr.seat")
            expect(seats).to_have_count(3)
            expect(page.locator('#recent-seats tr.seat[data-blamed="yes"]')).to_have_count(3)
            expect(seats.first).to_contain_text("blamed: rejected")
            page.screenshot(path=str(ARTIFACTS / "worker-quarantined.png"), full_page=True)

            # Release it through the list's action and its confirmation page.
            page.goto(f"{server}{listing}")
            page.check(f'input[name="_selected_action"][value="{flaky.pk}"]')
            page.select_option("select[name=action]", "release_selected")
            page.click("button[name=index]")
            expect(page.locator("#workers-to-release")).to_contain_text("will be released")
            page.click("input[type=submit][value='Yes, release']")
            expect(page.locator("ul.messagelist")).to_contain_text(
                "Released flaky-1 from quarantine."
            )
            row = page.locator("#result_list tbody tr", has_text="flaky-1").first
            expect(row.locator("td.field-quarantine")).to_have_text("-")
        finally:
            browser.close()

    flaky.refresh_from_db()
    assert not health.is_quarantined(flaky, timezone.now())
    assert flaky.blamed_in_row == 0
