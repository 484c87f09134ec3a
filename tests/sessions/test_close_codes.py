"""The close codes a session sends itself must be ones daphne's WebSocket library (autobahn)
lets a server's application send: it raises on any other, and the session then stays open."""

import pytest
from autobahn.twisted.websocket import WebSocketServerProtocol
from autobahn.websocket.protocol import WebSocketProtocol

from sessions import consumer

SENT_BY_THE_SESSION = {
    "CLOSE_ERROR": consumer.CLOSE_ERROR,
    "CLOSE_REVOKED": consumer.CLOSE_REVOKED,
    "CLOSE_SILENT": consumer.CLOSE_SILENT,
    "CLOSE_REPLACED": consumer.CLOSE_REPLACED,
}


def closed_protocol() -> WebSocketServerProtocol:
    """autobahn's server protocol after its close: sendClose checks the code, then sends
    nothing."""
    protocol = WebSocketServerProtocol()
    protocol.state = WebSocketProtocol.STATE_CLOSED
    return protocol


@pytest.mark.parametrize("name", sorted(SENT_BY_THE_SESSION))
def test_autobahn_lets_the_session_send_its_close_code(name):
    closed_protocol().sendClose(code=SENT_BY_THE_SESSION[name])


def test_the_check_refuses_what_autobahn_refuses():
    # 1011 was CLOSE_ERROR: a failed frame then left the session open, dropping its frames.
    with pytest.raises(Exception, match="invalid close code 1011"):
        closed_protocol().sendClose(code=1011)
