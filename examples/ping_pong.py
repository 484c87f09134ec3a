"""A distributed test of two members, run by gradient-worker (protocol.md, "Running real work").

The `server` member listens on its agent's endpoint and signals that it is ready; the `client`
member waits for that signal, finds the server through the roster and checks its answer. The
standard library only, so it runs with any python3 on any worker machine.
"""

import json
import os
import socket
import sys

WAIT_SECS = 60  # a member that never hears from its peer fails rather than hang


def signal_socket() -> socket.socket:
    """The agent's socket for this attempt: it replays every signal received so far, then
    each new one, and sends what is written to it."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(WAIT_SECS)
    sock.connect(os.environ["GRADIENT_SIGNAL_SOCKET"])
    return sock


def serve() -> int:
    _, _, port = os.environ["GRADIENT_ENDPOINT"].rpartition(":")
    with socket.create_server(("", int(port))) as server, signal_socket() as signals:
        server.settimeout(WAIT_SECS)
        # Listening before the signal: a client told "ready" never finds the port closed.
        signals.sendall(json.dumps({"to": None, "payload": "ready"}).encode() + b"\n")
        print(f"server: listening on port {port}, told the others", flush=True)
        conn, peer = server.accept()
        with conn:
            question = conn.makefile("r").readline().strip()
            conn.sendall(f"pong {question}\n".encode())
    print(f"server: answered {question!r} from {peer[0]}", flush=True)
    return 0


def ask() -> int:
    with signal_socket() as signals:
        for line in signals.makefile("r"):
            signal = json.loads(line)
            if signal.get("from", {}).get("role") == "server" and signal["payload"] == "ready":
                break
        else:
            print("client: the agent closed the signal socket", flush=True)
            return 1
    host, _, port = os.environ["GRADIENT_PEER_SERVER_0"].rpartition(":")
    print(f"client: the server is ready at {host}:{port}", flush=True)
    question = os.environ.get("PING_PONG_QUESTION", "ping")
    with socket.create_connection((host, int(port)), timeout=WAIT_SECS) as conn:
        conn.sendall(f"{question}\n".encode())
        answer = conn.makefile("r").readline().strip()
    if answer != f"pong {question}":
        print(f"client: expected 'pong {question}', got {answer!r}", flush=True)
        return 1
    print(f"client: the server answered {answer!r}", flush=True)
    return 0


if __name__ == "__main__":
    roles = {"server": serve, "client": ask}
    role = os.environ.get("GRADIENT_ROLE")
    if role not in roles:
        sys.exit(f"ping_pong: GRADIENT_ROLE must be server or client, not {role!r}")
    sys.exit(roles[role]())
