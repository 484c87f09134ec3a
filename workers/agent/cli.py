"""gradient-worker's command line: `gradient-worker [options]` runs the agent,
`gradient-worker signal send|wait ...` talks to the other members of a running cluster job."""

import asyncio
import os
import sys

from workers.agent import options as agent_options
from workers.agent import signal_cli
from workers.agent.log import Log
from workers.agent.service import EXIT_UNSENT, EXIT_USAGE, Service
from workers.client.events import now


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["signal"]:
        return signal_cli.main(argv[1:])
    try:
        options = agent_options.parse(argv, dict(os.environ))
    except agent_options.UsageError as exc:
        print(f"gradient-worker: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    os.environ.pop(agent_options.TOKEN_VARIABLE, None)  # read once; no process inherits it
    log = Log(options.log_format)
    try:
        return asyncio.run(Service(options, log).run())
    except Exception as exc:  # a bug: said in one line, with a status a supervisor restarts on
        log.write({"time": now(), "event": "fatal", "reason": repr(exc), "exit": EXIT_UNSENT})
        return EXIT_UNSENT
