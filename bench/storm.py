"""A connection storm: 1,000 reference workers connect at once to the web process (the
README's command: gradient.serve, a daphne per core on one socket), then it is killed and
started again on the same port and they all come back.

    .venv/bin/python bench/storm.py [--workers N] [--restarts N] [--write docs/benchmarks.md]

One process runs every worker (a Fleet of SimulatedWorkers, real WebSockets, ramp 0) against
the web process started as a subprocess. Measured: the time until every worker has its
InitAck; after each restart (SIGKILL of the launcher and its daphnes, then the same command on
the same port), the time until every worker has an InitAck on its new connection. daphne's log
is checked for consumers that crashed ("Exception inside application", tracebacks).

It uses its own database (--database, default gradient_bench; created and migrated when
missing, emptied at the start) and Redis database 10.
"""

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 10
SECTION = "## Connection storm"
BENCH = "storm"  # its name in bench/run, which its summary rows carry
BACK_TARGET_SECS = 5.0
TIMEOUT_SECS = 60.0


def make_workers(count: int) -> list[tuple[str, str]]:
    from workers.models import Worker, hash_token

    names = [(f"storm-{i:04d}", f"storm-token-{i}") for i in range(count)]
    Worker.objects.bulk_create(Worker(name=n, token_hash=hash_token(t)) for n, t in names)
    return names


def acks_since(worker, since: float) -> list[float]:
    return [
        datetime.fromisoformat(e["time"]).timestamp()
        for e in list(worker.events)
        if e["event"] == "init_ack" and datetime.fromisoformat(e["time"]).timestamp() >= since
    ]


async def until_all(fleet, wanted: dict, began: float, timeout: float) -> tuple[float, int]:
    """Wait until every worker has had wanted[worker] sessions (InitAcks): the seconds from
    `began`, or the timeout and how many workers were still short."""
    while True:
        short = sum(w.connections < wanted[w.name] for w in fleet.workers)
        if not short:
            return time.time() - began, 0
        if time.time() - began > timeout:
            return time.time() - began, short
        await asyncio.sleep(0.005)


def spread(fleet, began: float) -> dict:
    """Each worker's first InitAck since `began`, in seconds: median and p95 (of those that
    got one)."""
    firsts = [min(acks) - began for w in fleet.workers if (acks := acks_since(w, began))]
    if not firsts:
        return {"median": float("nan"), "p95": float("nan")}
    return {"median": statistics.median(firsts), "p95": common.percentile(firsts, 95)}


async def storm(url: str, names, procs: common.Processes, port: int, restarts: int) -> dict:
    from gradient import heap
    from workers.simulator import Fleet, WorkerConfig

    config = WorkerConfig()  # the reference worker as it ships: backoff 0.1 s doubling to 2 s
    fleet = Fleet([(n, t, config) for n, t in names], url=url, ramp_secs=0)
    heap.tune()  # as simulate_workers does: the fleet shares the cores with the stack
    began = time.time()
    running = asyncio.create_task(fleet.run())
    out = {"restarts": []}
    try:
        wanted = {w.name: 1 for w in fleet.workers}
        out["all"], out["missing"] = await until_all(fleet, wanted, began, TIMEOUT_SECS)
        out.update(spread(fleet, began))
        print(f"storm: {len(names) - out['missing']} InitAck after {out['all']:.2f} s", flush=True)
        await asyncio.sleep(2.0)  # let the sessions' RequestJobs settle
        for n in range(restarts):
            daphne = procs.procs[-1][0]
            procs.kill(daphne)
            killed = time.time()
            await asyncio.sleep(0.2)  # every worker sees its connection drop
            wanted = {w.name: w.connections + 1 for w in fleet.workers}
            restarted = time.time()
            proc = procs.start("daphne", *procs.daphne_args(port))
            await asyncio.to_thread(common.wait_for_port, port, proc)
            listening = time.time() - restarted
            back, missing = await until_all(fleet, wanted, restarted, TIMEOUT_SECS)
            row = {"listening": listening, "all": back, "missing": missing}
            row["down"] = restarted - killed
            row.update(spread(fleet, restarted))
            out["restarts"].append(row)
            print(
                f"restart {n + 1}: listening after {listening:.2f} s,"
                f" {len(names) - missing} back after {back:.2f} s",
                flush=True,
            )
            await asyncio.sleep(2.0)
        out["connected"] = sum(w.connected for w in fleet.workers)
        out["stopped"] = [w.stopped_reason for w in fleet.workers if w.stopped_reason]
    finally:
        fleet.stop()
        await running
    return out


def run(count: int, restarts: int) -> dict:
    common.ensure_database()
    names = make_workers(count)
    env = common.process_env()
    common.flush_redis(env["REDIS_URL"])
    logs = Path(tempfile.mkdtemp(prefix="bench-storm-"))
    procs = common.Processes(env, logs)
    try:
        port = common.free_port()
        procs.daphne(port)
        result = asyncio.run(storm(f"ws://127.0.0.1:{port}/proto", names, procs, port, restarts))
    finally:
        procs.stop()
        common.flush_redis(env["REDIS_URL"])
    log = procs.log_text("daphne")
    result["crashes"] = common.crashes(log)
    result["tracebacks"] = common.tracebacks(log)
    result["workers"] = count
    print(
        f"logs in {logs}; {len(result['crashes'])} crash(es),"
        f" {result['tracebacks']} traceback(s) in all",
        flush=True,
    )
    for line in result["crashes"][:5]:
        print("  " + line, flush=True)
    return result


HEADER = ["event", "workers", "every InitAck after s", "median s", "p95 s"]


def rows(r: dict) -> list[list]:
    events = [("storm: all connect at once (ramp 0)", r)] + [
        (f"restart {i}: SIGKILL, same command and port (listening after {x['listening']:.2f} s)", x)
        for i, x in enumerate(r["restarts"], 1)
    ]
    n = f"{r['workers']:,}"
    return [[e, n, every(x), f"{x['median']:.2f}", f"{x['p95']:.2f}"] for e, x in events]


def every(x: dict) -> str:
    if x["missing"]:
        return f"{x['missing']:,} still without after {x['all']:.0f}"
    return f"{x['all']:.2f}"


def figures(r: dict) -> list[common.Figure]:
    n = f"{r['workers']:,}"
    connected = r["workers"] - r["missing"]
    out = [
        common.Figure(
            f"storm of {n}: every worker's InitAck, no consumer crash",
            "every worker, 0 crashes",
            f"{connected:,} of {n} after {r['all']:.2f} s, {len(r['crashes'])} crashes",
            not r["missing"] and not r["crashes"],
        )
    ]
    if r["restarts"]:
        slowest = max(r["restarts"], key=lambda x: (x["missing"], x["all"]))
        out.append(
            common.Figure(
                f"storm of {n}: every worker back after a restart (slowest of"
                f" {len(r['restarts'])})",
                f"< {BACK_TARGET_SECS:g} s",
                f"{every(slowest)} s",
                not slowest["missing"] and slowest["all"] < BACK_TARGET_SECS,
            )
        )
    return out


LEAD = (
    "A reconnect storm: a fleet connects to the web process all at once, then the web process is"
    " killed and started again, and every worker comes back (see `bench/storm.py`)."
)


def method(workers: int) -> list[str]:
    return [
        f"Fleet: {workers:,} reference workers (a `Fleet` of `SimulatedWorker` in one process, real"
        " WebSockets, `ramp_secs=0`) with the shipped `WorkerConfig`: reconnect backoff 0.1 s"
        " doubling to 2 s, jittered.",
        "Server: the README's command, `python -m gradient.serve` (one daphne per core, 2 here, on"
        f" one socket), a subprocess on the bench database and Redis database {REDIS_DB}; no"
        " Celery, so the dispatch wake-ups only queue.",
        "Storm row: from the fleet's start until every worker has its InitAck; each session also"
        " sends its RequestJobs and answers its offers meanwhile.",
        "Restart rows: the launcher and its daphnes killed with SIGKILL, the same command started"
        " on the same port; from that start until every worker has an InitAck on a new"
        " connection, the daphnes' own start-up included. 'Listening' is when the launcher bound"
        " the socket, before any daphne imports Django: workers reconnecting meanwhile wait in"
        " its listen queue (backlog 1,024) instead of being refused.",
        "Median and p95: over each worker's first InitAck of the row.",
        "Where the time goes: a session's start is three statements (authenticate, attach,"
        " capabilities) and then one offer statement, on threads of their own"
        " (tests/sessions/test_session_start_cost.py); while starts are pending, other frames wait"
        " up to 5 s, so the InitAcks go first. From a restart to the last InitAck both cores are"
        " full: the daphnes spend about 6 s of CPU, a third of it importing Django, the project"
        " and Twisted, PostgreSQL about 2 s and the fleet about 1 s (/proc, py-spy).",
        "Spread: the last worker's return moves by about a second from run to run, with how"
        " evenly the kernel hands the connections to the two daphnes (640 and 360 of 1,000 in a"
        " slow restart).",
        f"Targets: every worker gets its InitAck; all back within {BACK_TARGET_SECS:g} s of a"
        " restart.",
    ]


def section(command: str, r: dict) -> str:
    facts = [
        f"Consumers that crashed (`Exception inside application` in daphne's log):"
        f" {len(r['crashes'])}; tracebacks of any kind there: {r['tracebacks']}.",
        *common.run_facts(command, r["load"]),
    ]
    body = common.table(HEADER, rows(r))
    return common.section_text(SECTION, LEAD, method(r["workers"]), facts, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", default=common.DEFAULT_DATABASE_URL)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--write", type=Path, help="update the section in this markdown file")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/storm.py", *sys.argv[1:]])
    common.raise_open_files(args.workers)
    common.setup(args.database, REDIS_DB)
    print(command, flush=True)
    before = common.load()
    result = run(args.workers, args.restarts)
    result["load"] = f"{before} at the start, {common.load()} at the end"
    print(common.table(HEADER, rows(result)), flush=True)
    if args.write:
        text = section(command, result)
        common.write_section(args.write, SECTION, text, BENCH, figures(result))
    if result["crashes"] or result["missing"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
