"""The worker agent: from StartCluster to each member's process running, on real agents.

    .venv/bin/python bench/agent.py [--trials N] [--sizes 2,4,8] [--write docs/benchmarks.md]

The method is in docs/benchmarks.md, "Worker agent: member start".
"""

import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from io import StringIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 4
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench_agent"
START_EVENT = "start_cluster"  # the agent's JSON log line when it handles StartCluster
SPREAD_TARGET_MS = 20.0
START_TARGET_MS = 50.0
TRIAL_TIMEOUT_SECS = 30.0
PROJECT = "bench-agent"
# What the server reads and an agent needs not: its members would inherit it.
SERVER_ONLY = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")


def make_workers(count: int, tmp: Path) -> list[tuple[str, Path]]:
    """Worker rows with tokens, and each token in a file of its own for --token-file."""
    from gradient.jobs.models import Project

    Project.objects.create(name=PROJECT)
    names = [f"agent-{i}" for i in range(count)]
    common.make_workers(names)
    out = []
    for name in names:
        path = tmp / f"{name}.token"
        path.write_text(common.token(name))
        path.chmod(0o600)
        out.append((name, path))
    return out


def start_agents(procs: common.Processes, url: str, workers, tmp: Path) -> list[int]:
    agent = str(common.VENV_BIN / "gradient-worker")
    env = {k: v for k, v in procs.env.items() if k not in SERVER_ONLY}
    for name, token in workers:
        procs.start(
            name,
            *(agent, "--url", url, "--builds", "1", "--log-format", "json"),
            *("--token-file", str(token), "--workdir", str(tmp / name)),
            *("--endpoint", f"127.0.0.1:{common.free_port()}", "--zone", "bench"),
            env=env,
        )
    names = [name for name, _ in workers]
    common.until(lambda: common.connected(names) == len(names), 60.0, "every agent connected")
    return procs.pids(*names)


def cluster_file(k: int, starts: Path, tmp: Path) -> Path:
    """The cluster as submit_cluster --file takes it: k build members, each writing the time
    it starts (sh and date: no interpreter to load) into STARTS/ASSIGNMENT_ID."""
    write_time = f'exec date +%s.%N > {shlex.quote(str(starts))}/"$GRADIENT_ASSIGNMENT_ID"'
    member = {"role": "node", "kind": "build", "command": ["sh", "-c", write_time]}
    path = tmp / f"cluster-{k}.json"
    path.write_text(json.dumps({"project": PROJECT, "members": [member] * k}))
    return path


def trial(path: Path, starts: Path) -> dict:
    """Submit one cluster and wait until it completes: its submission time and, per member,
    its assignment id and the time its process wrote."""
    from django.core.management import call_command

    from clusters.models import ClusterJob, ClusterStatus
    from gradient.jobs.models import DispatchedJob

    out = StringIO()
    submitted = time.time()
    call_command("submit_cluster", "--file", str(path), stdout=out)
    cluster = json.loads(out.getvalue())["cluster"]

    def finished():
        status = ClusterJob.objects.values_list("status", flat=True).get(pk=cluster)
        return None if status in (ClusterStatus.QUEUED, ClusterStatus.RUNNING) else status

    status = common.until(finished, TRIAL_TIMEOUT_SECS, f"end of cluster {cluster}")
    if status != ClusterStatus.COMPLETED:
        raise RuntimeError(f"cluster {cluster} ended {status}")
    seats = DispatchedJob.objects.filter(cluster_attempt__cluster_job_id=cluster)
    members = [
        {"assignment": str(pk), "running": float((starts / str(pk)).read_text())}
        for pk in seats.values_list("pk", flat=True)
    ]
    return {"cluster": cluster, "submitted": submitted, "members": members}


def agent_events(procs: common.Processes, names: list[str]) -> list[dict]:
    """Every agent's JSON log lines."""
    lines = (line for name in names for line in procs.log_text(name).splitlines())
    return [json.loads(line) for line in lines if line.startswith("{")]


def run(sizes: list[int], trials: int, settle_load: float) -> dict:
    common.ensure_database()
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    starts = tmp / "starts"
    starts.mkdir()
    workers = make_workers(max(sizes), tmp)
    common.settle(settle_load)
    load_before = common.load()
    names = [name for name, _ in workers]
    with common.stack("agent", logs=tmp / "logs") as procs:
        agents = start_agents(procs, procs.url, workers, tmp)
        files = {k: cluster_file(k, starts, tmp) for k in sizes}
        trial(files[max(sizes)], starts)  # warm-up, not counted: every agent has run once
        cpu_before = sum(common.cpu_secs(pid, children=False) for pid in agents)
        results = []
        for k in sizes:
            results += [{"k": k, **trial(files[k], starts)} for _ in range(trials)]
            print(f"{k} members: {trials} clusters completed", flush=True)
        cpu = sum(common.cpu_secs(pid, children=False) for pid in agents) - cpu_before
        for proc, _ in procs.procs:  # the agents first: they drain while the server is up
            if procs.names[proc.pid] in names:
                procs.kill(proc, signal.SIGTERM)
        crashes, tracebacks = procs.problems()
    events = agent_events(procs, names)
    received = {
        e["assignment_id"]: datetime.fromisoformat(e["time"]).timestamp()
        for e in events
        if e["event"] == START_EVENT
    }
    agent_errors = [e for e in events if e["level"] == "error"]
    for r in results:
        for m in r["members"]:
            m["start_ms"] = (m["running"] - received[m["assignment"]]) * 1000
    print(
        f"{len(crashes)} crash(es), {tracebacks} traceback(s), {len(agent_errors)} agent error(s)"
    )
    jobs = sum(r["k"] for r in results)
    return {
        "results": results,
        "sizes": sizes,
        "trials": trials,
        "agents": len(agents),
        "cpu_ms_per_job": cpu * 1000 / jobs,
        "jobs": jobs,
        "crashes": crashes,
        "tracebacks": tracebacks,
        "agent_errors": len(agent_errors),
        "load": common.load_span(load_before),
    }


def by_size(r: dict) -> dict[int, dict[str, list[float]]]:
    """Per cluster size: every member's StartCluster-to-running, each cluster's slowest member,
    its spread and its submission to its last member running, in ms."""
    out = {}
    for k in r["sizes"]:
        clusters = [c for c in r["results"] if c["k"] == k]
        running = [[m["running"] for m in c["members"]] for c in clusters]
        last = [max(t) - c["submitted"] for c, t in zip(clusters, running, strict=True)]
        out[k] = {
            "member": [m["start_ms"] for c in clusters for m in c["members"]],
            "slowest": [max(m["start_ms"] for m in c["members"]) for c in clusters],
            "spread": [(max(t) - min(t)) * 1000 for t in running],
            "submitted": [t * 1000 for t in last],
        }
    return out


HEADER = (
    "members | clusters | StartCluster to running, median ms | p95 ms"
    " | slowest member, median ms | spread first to last, median ms | p95 ms"
    " | submitted to last running, median ms"
)


def rows(r: dict) -> list[list]:
    def ms(xs, p=50):
        return f"{common.percentile(xs, p):.1f}"

    return [
        [
            k,
            len(x["spread"]),
            ms(x["member"]),
            ms(x["member"], 95),
            ms(x["slowest"]),
            ms(x["spread"]),
            ms(x["spread"], 95),
            ms(x["submitted"]),
        ]
        for k, x in by_size(r).items()
    ]


def figures(r: dict) -> list[common.Figure]:
    sizes = by_size(r)

    def worst(key: str) -> tuple[int, float]:
        return max(((k, statistics.median(x[key])) for k, x in sizes.items()), key=lambda p: p[1])

    over = ", ".join(map(str, r["sizes"]))
    (k1, spread), (k2, slowest) = worst("spread"), worst("slowest")
    return [
        common.Figure(
            f"agent: spread between a cluster's first and last member process start, median"
            f" (worst of {over} members)",
            f"< {SPREAD_TARGET_MS:.0f} ms",
            f"{spread:.1f} ms ({k1} members)",
            spread < SPREAD_TARGET_MS,
        ),
        common.Figure(
            f"agent: every member's process running after its StartCluster, median of the"
            f" slowest (worst of {over} members)",
            f"< {START_TARGET_MS:.0f} ms",
            f"{slowest:.1f} ms ({k2} members)",
            slowest < START_TARGET_MS,
        ),
    ]


def main() -> None:
    parser = common.parser(__doc__, DATABASE_URL, REDIS_DB, settle_load=1.5)
    parser.add_argument("--trials", type=int, default=100, help="clusters of each size")
    parser.add_argument("--sizes", default="2,4,8", help="cluster sizes; one agent per seat")
    args = parser.parse_args()
    sizes = common.parse_ints(args.sizes)
    if args.trials < 1 or min(sizes) < 1:
        parser.error("--trials and every size must be at least 1")
    common.start(args)
    r = run(sizes, args.trials, args.settle_load)
    facts = [
        f"Agent CPU: {r['cpu_ms_per_job']:.1f} ms per job ({r['jobs']} jobs).",
        common.crash_fact(len(r["crashes"]), r["tracebacks"])
        + f" Agent log lines at level error: {r['agent_errors']}.",
    ]
    common.finish(
        args,
        "agent",
        "## Worker agent: member start",
        common.table(HEADER, rows(r)),
        facts,
        figures(r),
        load=r["load"],
        crashed=bool(r["crashes"] or r["agent_errors"]),
    )


if __name__ == "__main__":
    main()
