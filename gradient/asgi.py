"""ASGI entry point: the admin over HTTP and the worker endpoint /proto over WebSocket."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

# Django must be set up before anything imports models.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from workers.consumer import WorkerConsumer  # noqa: E402

# No origin check on /proto: workers are machines authenticated by their bearer token.
application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": URLRouter([path("proto", WorkerConsumer.as_asgi())]),
    }
)
