"""daphne's own TLS endpoint, started as the README's "Behind TLS" says: a worker on wss:// is
served its work, the admin on https:// with HSTS, /metrics too; a client that does not trust
the certificate gets nothing."""

import asyncio
import datetime
import ipaddress
import json
import ssl
import urllib.request

import pytest
from asgiref.sync import sync_to_async
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.db import connection
from websockets.asyncio.client import connect

from tests.e2e.conftest import VENV_BIN, free_port, wait_for_port
from tests.e2e.test_worker_sessions import CAPS, bearer, recv_type
from tests.factories import BuildFactory, WorkerFactory
from workers.models import hash_token

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]


def q(fn):
    def run():
        try:
            return fn()
        finally:
            connection.close()

    return sync_to_async(run)()


def self_signed(directory) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1, as an operator's own CA would issue them."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.fixture
def tls_daphne(processes, tmp_path):
    """(port, certificate) of a daphne serving TLS itself, with GRADIENT_BEHIND_TLS=1."""
    key, cert = self_signed(tmp_path)
    port = free_port()
    endpoint = f"ssl:{port}:interface=127.0.0.1:privateKey={key}:certKey={cert}"
    proc = processes.start(
        f"daphne-{port}",
        str(VENV_BIN / "daphne"),
        "-e",
        endpoint,
        "gradient.asgi:application",
        GRADIENT_BEHIND_TLS="1",
    )
    wait_for_port(port, proc)
    return port, cert


async def test_a_worker_on_wss_is_assigned_its_job_with_the_work(tls_daphne):
    port, cert = tls_daphne
    await q(lambda: WorkerFactory(name="tls", token_hash=hash_token("t-tls")))
    build = await q(lambda: BuildFactory(command=["make", "check"], env={"V": "1"}))
    trusted = ssl.create_default_context(cafile=cert)

    async with connect(
        f"wss://127.0.0.1:{port}/proto", additional_headers=bearer("t-tls"), ssl=trusted
    ) as ws:
        await ws.send(json.dumps(CAPS))
        assert (await recv_type(ws, "InitAck"))["worker"] == "tls"
        await ws.send(json.dumps({"type": "RequestJob", "kind": "build"}))
        assign = await recv_type(ws, "AssignJob")

    assert assign["job_id"] == build.job_key
    assert (assign["job"]["command"], assign["job"]["env"]) == (["make", "check"], {"V": "1"})


async def test_a_client_that_does_not_trust_the_certificate_gets_nothing(tls_daphne):
    port, _ = tls_daphne
    await q(lambda: WorkerFactory(name="tls", token_hash=hash_token("t-tls")))
    with pytest.raises(ssl.SSLCertVerificationError):
        async with connect(
            f"wss://127.0.0.1:{port}/proto",
            additional_headers=bearer("t-tls"),
            ssl=ssl.create_default_context(),  # the system's authorities only
        ):
            pass


def fetch(url: str, cafile: str) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=cafile)
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.status, dict(response.headers)


async def test_the_admin_and_metrics_are_served_over_https_with_hsts(tls_daphne):
    port, cert = tls_daphne
    status, headers = await asyncio.to_thread(fetch, f"https://127.0.0.1:{port}/admin/login/", cert)
    assert status == 200
    assert headers["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
    assert "secure" in headers["Set-Cookie"].lower()
    status, _ = await asyncio.to_thread(fetch, f"https://127.0.0.1:{port}/metrics", cert)
    assert status == 200
    # The TLS port speaks nothing else: a plain request is dropped, never answered.
    with pytest.raises(OSError):
        await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics", cert)
