"""A connection storm: a fleet connects at once to the web process, which is then killed and
started again on the same port, and every worker comes back.

The method is in docs/benchmarks.md, "Connection storm".
"""

import asyncio
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 10
BACK_TARGET_SECS = 5.0
TIMEOUT_SECS = 60.0


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
    """Each worker's first InitAck since `began`, in seconds: median and p95."""
    firsts = []
    for w in fleet.workers:
        acks = [
            datetime.fromisoformat(e["time"]).timestamp()
            for e in list(w.events)
            if e["event"] == "init_ack"
        ]
        if acks := [t - began for t in acks if t >= began]:
            firsts.append(min(acks))
    if not firsts:
        return {"median": float("nan"), "p95": float("nan")}
    return dict(zip(("median", "p95"), common.median_p(firsts, 95), strict=True))


async def storm(names, procs: common.Processes, restarts: int) -> dict:
    from gradient import heap
    from workers.simulator import Fleet, WorkerConfig

    config = WorkerConfig()  # the reference worker as it ships: backoff 0.1 s doubling to 2 s
    fleet = Fleet([(n, common.token(n), config) for n in names], url=procs.url, ramp_secs=0)
    heap.tune()  # as simulate_workers does: the fleet shares the cores with the stack
    began = time.time()
    running = asyncio.create_task(fleet.run())
    out = {"restarts": []}
    try:
        wanted = {w.name: 1 for w in fleet.workers}
        out["all"], out["missing"] = await until_all(fleet, wanted, began, TIMEOUT_SECS)
        out.update(spread(fleet, began))
        await asyncio.sleep(2.0)  # let the sessions' RequestJobs settle
        for _ in range(restarts):
            daphne = procs.procs[-1][0]
            procs.kill(daphne)
            killed = time.time()
            await asyncio.sleep(0.2)  # every worker sees its connection drop
            wanted = {w.name: w.connections + 1 for w in fleet.workers}
            restarted = time.time()
            await asyncio.to_thread(procs.daphne)
            listening = time.time() - restarted
            back, missing = await until_all(fleet, wanted, restarted, TIMEOUT_SECS)
            row = {"listening": listening, "all": back, "missing": missing}
            row["down"] = restarted - killed
            row.update(spread(fleet, restarted))
            out["restarts"].append(row)
            await asyncio.sleep(2.0)
        out["connected"] = sum(w.connected for w in fleet.workers)
        out["stopped"] = [w.stopped_reason for w in fleet.workers if w.stopped_reason]
    finally:
        fleet.stop()
        await running
    return out


def run(count: int, restarts: int) -> dict:
    common.ensure_database()
    names = [f"storm-{i:04d}" for i in range(count)]
    common.make_workers(names)
    with common.stack("storm", celery=False) as procs:
        result = asyncio.run(storm(names, procs, restarts))
    result["crashes"], result["tracebacks"] = procs.problems()
    result["workers"] = count
    return result


HEADER = "event | workers | every InitAck after s | median s | p95 s"


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


def main() -> None:
    parser = common.parser(__doc__, redis_db=REDIS_DB)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--restarts", type=int, default=3)
    args = parser.parse_args()
    common.raise_open_files(args.workers)
    common.start(args)
    result = run(args.workers, args.restarts)
    crashes = common.crash_fact(len(result["crashes"]), result["tracebacks"], celery=False)
    common.finish(
        args,
        "storm",
        "## Connection storm",
        common.table(HEADER, rows(result)),
        [crashes],
        figures(result),
        crashed=bool(result["crashes"] or result["missing"]),
    )


if __name__ == "__main__":
    main()
