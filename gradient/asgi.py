"""ASGI entry point: the admin over HTTP and the worker endpoint /proto over WebSocket."""

import os
import pprint

from autobahn.websocket import protocol as autobahn_protocol
from daphne.ws_protocol import WebSocketProtocol as DaphneWebSocketProtocol
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

# Django must be set up before anything imports models.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from gradient import heap  # noqa: E402
from sessions.consumer import WorkerConsumer  # noqa: E402


class _Formatted:
    """pprint.pformat(obj), formatted only if the line is written."""

    def __init__(self, obj):
        self.obj = obj

    def __str__(self):
        return pprint.pformat(self.obj)


# autobahn pretty-prints its configuration for a debug line at every connection, debug logging
# on or off: formatted lazily instead.
if getattr(autobahn_protocol, "pformat", None) is pprint.pformat:
    autobahn_protocol.pformat = _Formatted

# Unless told otherwise, autobahn fails a connection (a frame over daphne's limit) by dropping
# TCP, and the worker gets 1006 instead of protocol.md's 1009; daphne has no option for it.
DaphneWebSocketProtocol.failByDrop = False

# No origin check on /proto: workers are machines authenticated by their bearer token.
application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": URLRouter([path("proto", WorkerConsumer.as_asgi())]),
    }
)

# Everything above is loaded for the life of the process.
heap.tune()
