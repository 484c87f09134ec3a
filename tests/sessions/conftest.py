import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from gradient.asgi import application
from tests.factories import WorkerFactory

CAPS = {
    "type": "WorkerCapabilities",
    "architectures": ["x86_64-linux"],
    "system_features": ["kvm"],
    "max_concurrent_builds": 1,
    "max_concurrent_evals": 1,
    "eval": True,
    "build": True,
    "fetch": True,
    "zone": "z1",
    "endpoint": "10.0.0.1:7000",
}


class Session:
    """A worker's side of /proto through Channels' communicator."""

    def __init__(self, token: str):
        self.token = token
        self.ws = WebsocketCommunicator(
            application, "/proto", headers=[(b"authorization", f"Bearer {token}".encode())]
        )

    async def connect(self):
        connected, code = await self.ws.connect()
        return connected, code

    async def send(self, frame):
        await self.ws.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout=3):
        return json.loads(await self.ws.receive_from(timeout))

    async def recv_type(self, name, timeout=3):
        """The next frame of this type; frames of other types before it are kept."""
        while True:
            frame = await self.recv(timeout)
            if frame["type"] == name:
                return frame

    async def silent(self, timeout=0.3):
        return await self.ws.receive_nothing(timeout)

    async def hello(self, **caps):
        await self.send({**CAPS, **caps})
        ack = await self.recv()
        assert ack["type"] == "InitAck", ack
        return ack

    async def close(self):
        await self.ws.disconnect()


@pytest.fixture
def worker_session(memory_layer, transactional_db):
    """make(name=..., **worker fields) -> (worker, Session) with a known token."""
    from workers.models import hash_token

    sessions = []

    async def make(**fields):
        name = fields.pop("name", None) or f"w{len(sessions)}"
        token = f"token-for-{name}"
        worker = await sync_to_async(WorkerFactory)(
            name=name, token_hash=hash_token(token), **fields
        )
        session = Session(token)
        sessions.append(session)
        return worker, session

    yield make
