"""One process of the fault suite's fleet: reference workers (workers.simulator) with the
suite's settings, a JSON line per event in --log, until SIGTERM (or SIGKILL, which is the point).

`simulate_workers` cannot give its workers a 1 s heartbeat (they would count as silent with a
short worker timeout) nor make some of them hang, so the suite starts this instead:

    python -m tests.faults.fleet_proc --prefix f0 --count 4 --zones a,b,c --url URL1,URL2 \
        --log events.jsonl [--hung 1] [--flaky reject,lose] [--zone-offset N]
"""

import argparse
import asyncio
import os
import signal

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--zones", default="a,b,c")
    parser.add_argument("--zone-offset", type=int, default=0)
    parser.add_argument("--url", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--hung", type=int, default=0, help="the first N hold members silently")
    parser.add_argument("--fail-rate", type=float, default=0.05)
    parser.add_argument(
        "--flaky",
        default="",
        metavar="WAY1,WAY2",
        help="the last workers are flaky, one per way (simulate_workers' FLAKY_WAYS)",
    )
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection

    from workers.management.commands.simulate_workers import FLAKY_WAYS, issue_tokens, sim_endpoint
    from workers.simulator import Fleet, WorkerConfig

    names = [f"{args.prefix}-{i}" for i in range(args.count)]
    ways = [way for way in args.flaky.split(",") if way]
    flaky = {names[-1 - i]: FLAKY_WAYS[way] for i, way in enumerate(ways)}
    zones = args.zones.split(",")
    tokens = issue_tokens(names, None)
    connection.close()
    configs = {
        name: WorkerConfig(
            zone=zones[(args.zone_offset + i) % len(zones)],
            endpoint=sim_endpoint(name),
            job_secs=(0.5, 2.0),
            fail_rate=args.fail_rate,
            answers_members=i >= args.hung,
            heartbeat_secs=1.0,
            backoff=(0.1, 1.0),
            open_timeout=5.0,
            max_events=50,
            **flaky.get(name, {}),
        )
        for i, name in enumerate(names)
    }
    fleet = Fleet(
        [(name, tokens[name], configs[name]) for name in names],
        url=args.url.split(","),
        log_path=args.log,
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, fleet.stop)
        await fleet.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
