"""gradient-worker's arguments (protocol.md, "The agent"): parsed and checked before anything
is sent, each mistake refused with one line. The token comes from GRADIENT_WORKER_TOKEN or
--token-file, never from an argument, so it shows in no process list."""

import argparse
import os
import platform
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from websockets.exceptions import InvalidURI
from websockets.uri import parse_uri

from gradient.wire import protocol as p

TOKEN_VARIABLE = "GRADIENT_WORKER_TOKEN"

EPILOG = f"""\
The token is read from {TOKEN_VARIABLE}, or from --token-file (which wins).

Signals: SIGTERM drains (Draining is sent, held cluster members are given up, running jobs
finish and are reported, then the agent exits). A second SIGTERM, or SIGINT, aborts the running
jobs (SIGTERM to each job's process group, SIGKILL --kill-grace seconds later), reports them and
exits.

Exit status:
  0  stopped as asked, every report sent
  1  stopped with reports it could not send, or an unexpected error
  2  bad arguments, no token, or an unreadable token file (nothing was sent)
  3  refused: the server kept refusing the token, or its certificate did not verify
  4  replaced: another agent connected with the same token

`gradient-worker signal send|wait ...` talks to the other members of a running cluster job
(see `gradient-worker signal --help`)."""


class UsageError(Exception):
    """A mistake in the arguments or the token: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage and message, as one line
        raise UsageError(message)


@dataclass(frozen=True)
class Options:
    urls: list[str]
    token: str
    capabilities: p.WorkerCapabilities
    workdir: Path
    store: Path
    cache: Path | None
    kill_grace: float
    ca_file: str | None
    log_format: str


def host_system() -> str:
    """This machine's Nix system name (x86_64-linux, aarch64-darwin, ...)."""
    machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine().lower())
    return f"{machine or platform.machine().lower()}-{sys.platform.removesuffix('2')}"


def parser() -> Parser:
    ap = Parser(
        prog="gradient-worker",
        description="Connects this machine to a gradient server and runs the jobs it assigns.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --token is no --token-file: a token is never an argument
    )
    # (option, metavar, help, argparse's other keywords)
    for option, metavar, text, more in (
        (
            "--url",
            "URL",
            "ws[s]://HOST:PORT/proto; repeated: tried in turn",
            {"action": "append", "required": True},
        ),
        ("--zone", "Z", "the zone this machine is in (same-zone clusters)", {}),
        ("--endpoint", "HOST:PORT", "where the other members of a cluster reach it", {}),
        ("--builds", "N", "build slots (default 1)", {"type": int, "default": 1}),
        ("--evals", "N", "evaluation slots (default 0)", {"type": int, "default": 0}),
        (
            "--arch",
            "A",
            f"a system it builds for, repeated (default {host_system()})",
            {"action": "append"},
        ),
        ("--features", "F1+F2", "its system features", {"default": ""}),
        (
            "--workdir",
            "DIR",
            "where jobs run (default ./gradient-worker)",
            {"default": "./gradient-worker"},
        ),
        (
            "--store",
            "DIR",
            "the Nix store it scores against (default /nix/store)",
            {"default": "/nix/store"},
        ),
        ("--cache", "DIR", "a Nix binary cache on disk: what absent paths weigh", {}),
        (
            "--kill-grace",
            "SECS",
            "from SIGTERM to SIGKILL as a job is ended (default 10)",
            {"type": float, "default": 10.0},
        ),
        (
            "--ca-file",
            "PEM",
            "the CAs a wss:// server is verified against (default the system's)",
            {},
        ),
        ("--token-file", "FILE", f"the file holding the token (else ${TOKEN_VARIABLE})", {}),
        (
            "--log-format",
            "text|json",
            "one line per event on stderr (default text)",
            {"choices": ("text", "json"), "default": "text"},
        ),
    ):
        ap.add_argument(option, metavar=metavar, help=text, **more)
    return ap


def parse(argv: list[str], environ: dict[str, str]) -> Options:
    """The agent's options, or UsageError naming the first mistake."""
    args = parser().parse_args(argv)
    for url in args.url:
        try:
            parse_uri(url)
        except InvalidURI:
            raise UsageError(f"--url {url!r} is not a ws:// or wss:// URL") from None
    if args.builds < 0 or args.evals < 0:
        raise UsageError("--builds and --evals cannot be negative")
    if args.builds == args.evals == 0:
        raise UsageError("--builds and --evals are both 0: the agent would take no job")
    if not 0 <= args.kill_grace < float("inf"):
        raise UsageError("--kill-grace must be a number of seconds, 0 or more")
    if args.cache is not None and not Path(args.cache).is_dir():
        raise UsageError(f"--cache {args.cache!r} is not a directory")
    if args.ca_file is not None:
        try:
            ssl.create_default_context(cafile=args.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--ca-file {args.ca_file!r}: {exc}") from None
    return Options(
        urls=args.url,
        token=token(args.token_file, environ),
        capabilities=capabilities(args),
        workdir=workdir(args.workdir),
        store=Path(args.store),
        cache=Path(args.cache) if args.cache is not None else None,
        kill_grace=args.kill_grace,
        ca_file=args.ca_file,
        log_format=args.log_format,
    )


def capabilities(args: argparse.Namespace) -> p.WorkerCapabilities:
    features = args.features.split("+") if args.features else []
    if "" in features:
        raise UsageError(f"--features {args.features!r}: an empty feature (write F1+F2)")
    if args.endpoint is not None:
        host, _, port = args.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--endpoint {args.endpoint!r} is not HOST:PORT")
    options = {"architectures": "--arch", "system_features": "--features", "zone": "--zone"}
    options |= {"endpoint": "--endpoint", "max_concurrent_builds": "--builds"}
    options |= {"max_concurrent_evals": "--evals"}
    try:
        return p.WorkerCapabilities(
            architectures=args.arch or [host_system()],
            system_features=features,
            max_concurrent_builds=args.builds,
            max_concurrent_evals=args.evals,
            eval=args.evals > 0,
            build=args.builds > 0,
            fetch=False,
            zone=args.zone,
            endpoint=args.endpoint,
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        raise UsageError(
            f"{options.get(error['loc'][0], error['loc'][0])}: {error['msg']}"
        ) from None


def token(token_file: str | None, environ: dict[str, str]) -> str:
    if token_file is not None:
        try:
            value = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --token-file {token_file!r}: {exc}") from None
        where = f"--token-file {token_file!r}"
    else:
        value = environ.get(TOKEN_VARIABLE, "").strip()
        where = TOKEN_VARIABLE
    if not value:
        if token_file is None:
            raise UsageError(f"no token: set {TOKEN_VARIABLE} or give --token-file")
        raise UsageError(f"{where} is empty")
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise UsageError(f"{where}: a token is one word of printable ASCII")
    return value


def workdir(path: str) -> Path:
    directory = Path(path).absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--workdir {path!r}: {exc.strerror or exc}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"--workdir {path!r} is not writable")
    return directory
