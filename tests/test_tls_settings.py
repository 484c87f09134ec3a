"""Behind TLS (README, "Behind TLS"): GRADIENT_BEHIND_TLS switches on what `check --deploy`
asks for, and the HTTPS redirect spares /metrics and never reaches the worker endpoint."""

import json
import os
import subprocess
import sys

import pytest
from channels.testing import WebsocketCommunicator

from gradient.asgi import application
from tests.commands import ROOT
from tests.factories import WorkerFactory
from workers.models import hash_token

# The deployment settings, as the README's section names them; the rest of the environment
# is the test run's, but for them.
TLS_SETTINGS = (
    "GRADIENT_BEHIND_TLS",
    "DJANGO_SECURE_HSTS_SECONDS",
    "DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "DJANGO_SECURE_HSTS_PRELOAD",
    "DJANGO_SECURE_PROXY_SSL_HEADER",
)


def manage(*args, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in TLS_SETTINGS}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_deploy_is_clean_behind_tls():
    done = manage("check", "--deploy", "--fail-level", "WARNING", GRADIENT_BEHIND_TLS="1")
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


def test_by_default_nothing_of_it_is_on_for_local_use():
    done = manage("check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode != 0
    warned = {
        line.split(")")[0].split("(")[-1] for line in done.stderr.splitlines() if "?: (" in line
    }
    assert warned == {"security.W004", "security.W008", "security.W012", "security.W016"}


OFF = {
    "SECURE_SSL_REDIRECT": False,
    "SESSION_COOKIE_SECURE": False,
    "CSRF_COOKIE_SECURE": False,
    "SECURE_HSTS_SECONDS": 0,
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": False,
    "SECURE_HSTS_PRELOAD": False,
    "SECURE_PROXY_SSL_HEADER": None,
}
ON = {
    "SECURE_SSL_REDIRECT": True,
    "SESSION_COOKIE_SECURE": True,
    "CSRF_COOKIE_SECURE": True,
    "SECURE_HSTS_SECONDS": 31_536_000,
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
    "SECURE_HSTS_PRELOAD": True,
    "SECURE_PROXY_SSL_HEADER": None,
}


def settings_of(**env) -> dict:
    """The settings of OFF as a process started with `env` reads them."""
    code = (
        "import json; from django.conf import settings as s;"
        f" print(json.dumps({{n: getattr(s, n) for n in {tuple(OFF)}}}))"
    )
    done = manage("shell", "-v", "0", "-c", code, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_switch_its_overrides_and_the_proxys_header():
    assert settings_of() == OFF
    assert settings_of(GRADIENT_BEHIND_TLS="1") == ON
    assert settings_of(
        GRADIENT_BEHIND_TLS="1",
        DJANGO_SECURE_HSTS_SECONDS="3600",
        DJANGO_SECURE_HSTS_PRELOAD="0",
        DJANGO_SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
    ) == ON | {
        "SECURE_HSTS_SECONDS": 3600,
        "SECURE_HSTS_PRELOAD": False,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
    }


@pytest.fixture
def behind_a_proxy(settings):
    """The settings GRADIENT_BEHIND_TLS=1 and DJANGO_SECURE_PROXY_SSL_HEADER=X-Forwarded-Proto
    give, on the live settings (the test client builds its middleware per client)."""
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 31_536_000
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = True
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")


@pytest.mark.django_db
@pytest.mark.usefixtures("behind_a_proxy")
def test_plain_http_is_sent_to_https_but_for_metrics(client):
    response = client.get("/admin/login/")
    assert (response.status_code, response["Location"]) == (
        301,
        "https://testserver/admin/login/",
    )
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "gradient_" in metrics.text


@pytest.mark.django_db
@pytest.mark.usefixtures("behind_a_proxy")
def test_a_request_the_proxy_marks_as_tls_is_served_with_hsts_and_secure_cookies(client):
    response = client.get("/admin/login/", headers={"X-Forwarded-Proto": "https"})
    assert response.status_code == 200
    assert response["Strict-Transport-Security"].startswith("max-age=31536000")
    assert response.cookies["csrftoken"]["secure"] is True


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
@pytest.mark.usefixtures("behind_a_proxy", "memory_layer")
async def test_the_worker_endpoint_is_never_redirected():
    """/proto is routed apart from Django's middleware: a worker on ws:// behind the proxy,
    or on wss:// itself, opens its session whatever the redirect says."""
    from asgiref.sync import sync_to_async

    await sync_to_async(WorkerFactory)(name="w", token_hash=hash_token("t"))
    ws = WebsocketCommunicator(application, "/proto", headers=[(b"authorization", b"Bearer t")])
    connected, _ = await ws.connect()
    assert connected
    await ws.disconnect()
