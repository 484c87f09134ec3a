"""A real gradient-worker process for tests: started with --log-format json, its log lines
read as they come, so a test waits for an event ("started", "completed", ...) with a bound
instead of sleeping. Killed, with its process group, if a test leaves it running."""

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

AGENT = str(Path(sys.executable).parent / "gradient-worker")
TOKEN = "secret-token"


def agent_env(token: str | None = TOKEN, **extra: str) -> dict[str, str]:
    """What an operator's machine has: no Django settings, no database, no Redis."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL")
        and not k.startswith("GRADIENT_")
    }
    if token is not None:
        env["GRADIENT_WORKER_TOKEN"] = token
    return env | extra


class AgentProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.args = [AGENT, *args, "--log-format", "json"]
        self.env = agent_env() if env is None else env
        self.events: list[dict] = []
        self.lines: list[str] = []  # stderr lines that are not JSON (there should be none)
        self._new = asyncio.Event()

    async def __aenter__(self):
        self.proc = await asyncio.create_subprocess_exec(
            *self.args,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc):
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        await self._reader

    async def _read(self):
        async for raw in self.proc.stderr:
            line = raw.decode().rstrip("\n")
            try:
                self.events.append(json.loads(line))
            except ValueError:
                self.lines.append(line)
            self._new.set()
        self._new.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait_event(self, event: str, timeout: float = 10.0, **fields) -> dict:
        """The first logged event of that name whose fields match."""
        async with asyncio.timeout(timeout):
            while True:
                for entry in self.events:
                    if entry["event"] == event and all(
                        entry.get(k) == v for k, v in fields.items()
                    ):
                        return entry
                if self._reader.done():
                    raise AssertionError(f"the agent exited without logging {event} {fields}")
                self._new.clear()
                await self._new.wait()

    async def exit_status(self, timeout: float = 10.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def named(self, event: str) -> list[dict]:
        return [entry for entry in self.events if entry["event"] == event]
