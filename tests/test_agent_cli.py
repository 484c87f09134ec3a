"""gradient-worker's command line as an operator meets it: a real process, started without the
server's settings. A mistake in the arguments or the token is one line on stderr and exit 2,
before anything is sent."""

import asyncio
import subprocess
import sys

import pytest

from tests.agent_harness import AGENT, agent_env
from tests.fake_server import FakeServer


async def agent(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
    proc = await asyncio.create_subprocess_exec(
        AGENT,
        *args,
        env=agent_env() if env is None else env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    return proc.returncode, out.decode(), err.decode().splitlines()


BAD = [
    ([], "the following arguments are required: --url"),
    (["--url", "http://127.0.0.1:1/proto"], "is not a ws:// or wss:// URL"),
    (["--builds", "two"], "argument --builds: invalid int value: 'two'"),
    (["--builds", "-1"], "--builds and --evals cannot be negative"),
    (["--builds", "0"], "--builds and --evals are both 0"),
    (["--evals", str(2**31)], "--evals:"),
    (["--arch", "x" * 65], "--arch:"),
    (["--features", "kvm++big"], "an empty feature"),
    (["--endpoint", "nohost"], "--endpoint 'nohost' is not HOST:PORT"),
    (["--endpoint", "h:99999"], "is not HOST:PORT"),
    (["--zone", "z\x01" * 101], "--zone:"),
    (["--kill-grace", "-1"], "--kill-grace must be a number of seconds"),
    (["--kill-grace", "nan"], "--kill-grace must be a number of seconds"),
    (["--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
    (["--cache", "/nonexistent/cache"], "--cache '/nonexistent/cache' is not a directory"),
    (["--ca-file", "/nonexistent/ca.pem"], "--ca-file '/nonexistent/ca.pem'"),
    (["--workdir", "/proc/no/such"], "--workdir '/proc/no/such'"),
    (["--token", "secret"], "unrecognized arguments: --token secret"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("args", "says"), BAD)
async def test_a_bad_argument_is_one_line_on_stderr_and_exit_2_with_nothing_sent(args, says):
    async with FakeServer() as server:
        url = ["--url", server.url] if "--url" not in args and args else []
        status, out, err = await agent(*url, *args)
    assert (status, out, len(err)) == (2, "", 1), err
    assert err[0].startswith("gradient-worker: ") and says in err[0]
    assert server.handshakes == 0


@pytest.mark.asyncio
async def test_without_a_token_it_says_where_one_comes_from_and_exits_2():
    async with FakeServer() as server:
        status, out, err = await agent("--url", server.url, env=agent_env(token=None))
    assert (status, out, server.handshakes) == (2, "", 0)
    assert err == ["gradient-worker: no token: set GRADIENT_WORKER_TOKEN or give --token-file"]


@pytest.mark.asyncio
async def test_an_unreadable_or_empty_token_file_exits_2(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    async with FakeServer() as server:
        missing = await agent("--url", server.url, "--token-file", str(tmp_path / "none"))
        blank = await agent("--url", server.url, "--token-file", str(empty))
    assert missing[:2] == blank[:2] == (2, "")
    assert missing[2][0].startswith(f"gradient-worker: cannot read --token-file '{tmp_path}/none'")
    assert blank[2] == [f"gradient-worker: --token-file '{empty}' is empty"]
    assert server.handshakes == 0


@pytest.mark.asyncio
async def test_the_token_file_is_read_and_sent_as_the_bearer(tmp_path):
    token = tmp_path / "token"
    token.write_text("from-the-file\n")
    async with FakeServer() as server:
        proc = await asyncio.create_subprocess_exec(
            AGENT,
            "--url",
            server.url,
            "--token-file",
            str(token),
            env=agent_env(token=None),
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await server.session()
        finally:
            proc.kill()
            await proc.wait()
    assert server.authorizations == ["Bearer from-the-file"]


def test_help_lists_the_options_and_the_exit_statuses():
    done = subprocess.run([AGENT, "--help"], env=agent_env(), capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""
    for option in ("--url", "--kill-grace SECS", "--token-file FILE", "--log-format"):
        assert option in done.stdout
    assert "3  refused" in done.stdout and "SIGTERM drains" in done.stdout


def test_the_agent_imports_neither_django_nor_celery():
    """A worker machine has no server settings: the agent must start without them."""
    check = "import workers.agent.cli, sys; assert 'django' not in sys.modules, 'django'; "
    check += "assert 'celery' not in sys.modules, 'celery'"
    done = subprocess.run([sys.executable, "-c", check], env=agent_env(), capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_signal_is_dispatched_to_the_signal_command():
    done = subprocess.run(
        [AGENT, "signal", "send", "{}"], env=agent_env(), capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.startswith("gradient-worker signal: GRADIENT_SIGNAL_SOCKET is not set")
