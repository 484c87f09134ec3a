"""Gang start on real agents, a deep cluster queue and a connected fleet's idle cost (parts idle,
start, sustained: `bench/run gang-start-agents`), and the agent's own member start (part agent:
`bench/run agent`). --profile PY_SPY (with --only sustained) logs every statement of the bench
database and records py-spy on daphne and Celery, and prints what it found; the figures then
carry that overhead. The methods are in docs/benchmarks.md."""

import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime
from io import StringIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common

REDIS_DB = 6
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench_gang"
SECTION = "## Gang start on agents and a deep cluster queue"
AGENT_SECTION = "## Worker agent: member start"
AGENTS = 8
SIZES = (2, 3, 4)
AGENT_SIZES = (2, 4, 8)
PARTS = ("idle", "start", "sustained", "agent")
START_MEDIAN_MS, START_P95_MS = 35.0, 50.0
CONTROL_MS, WHOLE_MS, FLAT_SHARE, IDLE_MS = 10.0, 25.0, 0.10, 8.0
SPREAD_TARGET_MS, AGENT_START_MS = 20.0, 50.0
MEMBER_SECS = 0.3
CONTROL = ("daphne", "celery worker", "beat", "postgres", "redis")
PG_LOG = Path("/var/log/postgresql/postgresql-15-main.log")
PROJECT = "bench-agent"
START_EVENT = "start_cluster"  # the agent's JSON log line when it handles StartCluster
# What the server reads and an agent needs not: its members would inherit it.
SERVER_ONLY = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")


class Stack:
    """Redis, daphne, Celery and the agents, on the bench database."""

    def __init__(self, tmp: Path, redis_port: int):
        from gradient.jobs.models import Project

        self.tmp = tmp
        self.procs = common.Processes(common.process_env(), tmp / "logs")
        redis = self.procs.start("redis", "redis-server", "--port", str(redis_port), "--save", "")
        common.until(lambda: redis.poll() is None and common.listening(redis_port), 30.0, "Redis")
        Project.objects.create(name=PROJECT)
        self.names = [f"agent-{i}" for i in range(AGENTS)]
        common.make_workers(self.names)
        self.url = self.procs.url

    def start(self) -> None:
        self.procs.daphne()
        self.procs.celery()
        agent = str(common.VENV_BIN / "gradient-worker")
        env = {k: v for k, v in self.procs.env.items() if k not in SERVER_ONLY}
        for name in self.names:
            token = self.tmp / f"{name}.token"
            token.write_text(common.token(name))
            token.chmod(0o600)
            self.procs.start(
                name,
                *(agent, "--url", self.url, "--builds", "1", "--log-format", "json"),
                *("--token-file", str(token), "--workdir", str(self.tmp / name)),
                *("--endpoint", f"127.0.0.1:{common.free_port()}", "--zone", "bench"),
                env=env,
            )
        every = lambda: common.connected("agent-") == AGENTS  # noqa: E731
        common.until(every, 60.0, "every agent connected")
        self.agents = self.procs.pids(*self.names)

    def stop_agents(self) -> None:
        for proc, _ in self.procs.procs:
            if proc.pid in self.agents:
                self.procs.kill(proc, signal.SIGTERM)

    def meter(self) -> common.CpuMeter:
        p = self.procs.pids
        groups = {"daphne": p("daphne"), "celery worker": p("celery-worker")}
        groups |= {"beat": p("celery-beat"), "redis": p("redis")}
        return common.CpuMeter(groups, exclude_backends=[common.backend_pid()])

    def agents_cpu(self) -> float:
        return sum(common.cpu_secs(pid, children=False) for pid in self.agents)

    def events(self) -> list[dict]:
        """Every agent's JSON log lines."""
        lines = (line for name in self.names for line in self.procs.log_text(name).splitlines())
        return [json.loads(line) for line in lines if line.startswith("{")]


def measured(stack: Stack, wait) -> dict:
    """CPU seconds of each process while `wait()` runs, and its wall time."""
    meter = stack.meter()
    meter.start()
    agents_before, began = stack.agents_cpu(), time.monotonic()
    wait()
    spent = meter.stop()
    spent["agents"] = stack.agents_cpu() - agents_before
    return {"cpu": spent, "secs": time.monotonic() - began}


# Idle


def idle(stack: Stack, secs: float) -> dict:
    time.sleep(3.0)  # the agents' first RequestJobs answered
    return measured(stack, lambda: time.sleep(secs))


def idle_simulated(stack: Stack, count: int, secs: float) -> dict:
    """With the agents stopped and nothing left queued: a cluster waiting would wake a pass
    at each of their RequestJobs."""
    from clusters.abort import AbortRefused, abort_cluster
    from clusters.models import ClusterJob, ClusterStatus

    stack.stop_agents()
    logging.getLogger("clusters").setLevel(logging.WARNING)  # a line per abort is noise here
    for pk in ClusterJob.objects.filter(status=ClusterStatus.QUEUED).values_list("pk", flat=True):
        with contextlib.suppress(AbortRefused):  # ended or claimed meanwhile
            abort_cluster(pk)
    common.analyze(vacuum=True)
    stack.procs.start(
        "simulated",
        *(str(common.VENV_BIN / "python"), "manage.py", "simulate_workers"),
        *("--count", str(count), "--prefix", "idle", "--url", stack.url),
    )
    common.until(lambda: common.connected("idle-") == count, 120.0, f"{count} connected", 0.5)
    time.sleep(10.0)  # past the connect storm and each one's first resend
    return measured(stack, lambda: time.sleep(secs))


# Gang start


def cluster_file(k: int, starts: Path) -> Path:
    """The cluster as submit_cluster --file takes it: k build members, each writing the time
    it starts (sh and date: no interpreter to load) into STARTS/ASSIGNMENT_ID."""
    write_time = f'exec date +%s.%N > {shlex.quote(str(starts))}/"$GRADIENT_ASSIGNMENT_ID"'
    member = {"role": "node", "kind": "build", "command": ["sh", "-c", write_time]}
    path = starts.parent / f"cluster-{k}.json"
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

    status = common.until(finished, 30.0, f"end of cluster {cluster}")
    if status != ClusterStatus.COMPLETED:
        raise RuntimeError(f"cluster {cluster} ended {status}")
    seats = DispatchedJob.objects.filter(cluster_attempt__cluster_job_id=cluster)
    members = [
        {"assignment": str(pk), "running": float((starts / str(pk)).read_text())}
        for pk in seats.values_list("pk", flat=True)
    ]
    return {"submitted": submitted, "members": members}


def trials(stack: Stack, sizes: tuple, count: int, pause: float) -> tuple[list[dict], float]:
    """`count` clusters of each size one at a time, after one of the largest (not counted),
    each with the time of its commit; and the agents' CPU seconds over the counted ones."""
    from clusters import submission

    starts = stack.tmp / f"starts-{'-'.join(map(str, sizes))}"
    starts.mkdir()
    files = {k: cluster_file(k, starts) for k in sizes}
    commits: list[float] = []
    wake = submission.wake_dispatch

    def marked_wake():  # run on commit: the clock starts there
        commits.append(time.time())
        return wake()

    submission.wake_dispatch = marked_wake
    try:
        trial(files[max(sizes)], starts)
        cpu = stack.agents_cpu()
        results = []
        for k in sizes:
            for _ in range(count):
                time.sleep(pause)
                results.append({"k": k, **trial(files[k], starts), "commit": commits[-1]})
        cpu = stack.agents_cpu() - cpu
    finally:
        submission.wake_dispatch = wake
    received = {
        e["assignment_id"]: datetime.fromisoformat(e["time"]).timestamp()
        for e in stack.events()
        if e["event"] == START_EVENT
    }
    for r in results:
        for m in r["members"]:
            m["received"] = received[m["assignment"]]
    return results, cpu


# Sustained


def submit_all(count: int) -> None:
    from clusters.submission import MemberSpec, submit_cluster
    from gradient.jobs.submission import JobSpec

    job = JobSpec(kind="build", command=["sleep", str(MEMBER_SECS)])
    members = [MemberSpec(role="node", job=job)] * 3
    for _ in range(count):
        submit_cluster(PROJECT, members)


def completed_members() -> int:
    from gradient.jobs.models import BuildStatus, DerivationBuild

    return DerivationBuild.objects.filter(status=BuildStatus.COMPLETED).count()


def sustained(stack: Stack, queued: int, window: int, profile: str | None) -> dict:
    """`queued` clusters at once; the CPU over the next `window` member completions (or until
    every member completed)."""
    began = completed_members()
    submit_all(queued)
    # Dead rows cleared and statistics taken, as autovacuum would on a server (this host's
    # PostgreSQL runs without it): the run's own churn would otherwise pile up.
    common.analyze(vacuum=True)
    first = completed_members()
    goal = min(first + window, began + 3 * queued)
    spy = start_py_spy(stack, profile, queued) if profile else None
    marks = (time.time(), PG_LOG.stat().st_size if profile else 0)
    done = lambda: completed_members() >= goal  # noqa: E731
    result = measured(stack, lambda: common.until(done, 600.0, f"{goal} members", 0.2))
    if spy:
        stop_py_spy(spy)
        result["statements"] = statements(marks, time.time(), common.backend_pid())
    members = completed_members() - first
    return {"queued": queued, "members": members, "ahead": first - began, **result}


# Profile


def start_py_spy(stack: Stack, py_spy: str, queued: int) -> list[subprocess.Popen]:
    spies = []
    for name in ("daphne", "celery-worker"):
        out = stack.tmp / f"py-spy-{name}-{queued}.txt"
        args = [py_spy, "record", "-f", "raw", "-r", "100", "--subprocesses", "--nonblocking"]
        pid = str(stack.procs.pids(name)[0])
        spies.append(
            subprocess.Popen([*args, "-p", pid, "-o", str(out)], stderr=subprocess.DEVNULL)
        )
    return spies


def stop_py_spy(spies: list[subprocess.Popen]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        spy.wait(60)


RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \w+) \[(\d+)\] \S+@(\S+) (\w+):  (.*)")
DURATION = re.compile(r"duration: ([0-9.]+) ms  (parse|bind|execute) [^:]*: (.*)", re.S)


def statements(marks: tuple[float, int], until: float, own_pid: int) -> dict:
    """The bench database's statements logged in the window (the bench's own backend left
    out): per statement text, the executions and the milliseconds of parse, bind and execute."""
    from django.db import connection

    since, offset = marks
    name = connection.settings_dict["NAME"]
    with PG_LOG.open(errors="replace") as log:
        log.seek(offset)
        text = log.read()
    records, calls, ms = [], Counter(), defaultdict(float)
    for line in text.splitlines():
        if found := RECORD.match(line):
            records.append([*found.groups()])
        elif records:
            records[-1][4] += "\n" + line
    for stamp, pid, db, level, message in records:
        when = datetime.strptime(stamp.rsplit(" ", 1)[0], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        found = DURATION.match(message)
        if db != name or int(pid) == own_pid or level != "LOG" or not found or when < since:
            continue
        if when > until:
            break
        key = " ".join(found.group(3).split())[:110]
        ms[key] += float(found.group(1))
        calls[key] += found.group(2) == "execute"
    return {"calls": calls, "ms": ms}


def log_statements(on: bool) -> None:
    from django.db import connection

    setting = "SET log_min_duration_statement = 0" if on else "RESET log_min_duration_statement"
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER DATABASE "{connection.settings_dict["NAME"]}" {setting}')


PROJECT_FRAME = re.compile(r"\((clusters|workers|gradient)/")


def py_spy_top(path: Path, count: int = 12) -> list[str]:
    """From py-spy's raw output: the project's functions by inclusive samples, then every
    function by its own (leaf) samples, each as a share of all samples."""
    inclusive, leaf, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        total += int(n)
        leaf[frames[-1]] += int(n)
        for frame in {f for f in frames if PROJECT_FRAME.search(f)}:
            inclusive[frame] += int(n)
    return [
        f"{label} {n * 100 / total:5.1f}%  {frame}"
        for label, counter in (("incl", inclusive), ("self", leaf))
        for frame, n in counter.most_common(count)
    ] + [f"{total} samples"]


# The run


def run(args) -> dict:
    common.ensure_database()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gang-agents-"))
    stack = Stack(tmp, args.redis_port)
    if args.profile:
        log_statements(True)
    common.analyze()
    common.settle(args.settle_load)
    out = {"load": [common.load()], "simulated_count": args.simulated}
    try:
        stack.start()
        time.sleep(5.0)  # past beat's and the pool's start-up
        if "idle" in args.only:
            out["idle"] = idle(stack, args.idle_secs)
        if "start" in args.only:
            out["trials"], _ = trials(stack, SIZES, args.trials, 0.3)  # every agent idle again
        if "agent" in args.only:
            out["agent"], out["agent_cpu"] = trials(stack, AGENT_SIZES, args.agent_trials, 0.0)
            out["agent_load"] = common.load()
        if "sustained" in args.only:
            out["sustained"] = []
            for queued in args.queued:
                out["sustained"].append(sustained(stack, queued, args.window, args.profile))
                out["load"].append(common.load())
        if "idle" in args.only and args.simulated:
            out["simulated"] = idle_simulated(stack, args.simulated, args.idle_secs)
        stack.stop_agents()
        out["crashes"], out["tracebacks"] = stack.procs.problems()
        out["agent_errors"] = sum(e["level"] == "error" for e in stack.events())
    finally:
        stack.procs.stop()
        if args.profile:
            log_statements(False)
    if args.profile:
        print_profile(out, tmp)
    print(f"logs in {tmp / 'logs'}", flush=True)
    return out


def print_profile(out: dict, tmp: Path) -> None:
    for r in out.get("sustained", []):
        n, s = r["members"], r["statements"]
        print(
            f"\n{r['queued']} queued, {n} members: {sum(s['calls'].values()) / n:.1f} statements"
            f" per member, {sum(s['ms'].values()) / n:.1f} ms of statement time per member"
        )
        for key, ms in sorted(s["ms"].items(), key=lambda p: -p[1])[:15]:
            calls = s["calls"][key]
            each = ms / calls if calls else 0.0
            print(f"  {ms:8.0f} ms {calls / n:5.2f}/member {each:7.2f} ms each  {key}")
        for name in ("daphne", "celery-worker"):
            path = tmp / f"py-spy-{name}-{r['queued']}.txt"
            if path.exists():
                print(f"  py-spy {name}:", *py_spy_top(path), sep="\n    ")


START_COLUMNS = (
    ("commit to StartCluster at the last member, median ms", "start_cluster", 50),
    ("p95 ms", "start_cluster", 95),
    ("commit to every member running, median ms", "running", 50),
    ("p95 ms", "running", 95),
)
AGENT_COLUMNS = (
    ("StartCluster to running, median ms", "member", 50),
    ("p95 ms", "member", 95),
    ("slowest member, median ms", "slowest", 50),
    ("spread first to last, median ms", "spread", 50),
    ("p95 ms", "spread", 95),
    ("submitted to last running, median ms", "submitted", 50),
)


def by_size(trials: list[dict], k: int) -> dict[str, list[float]]:
    """In ms, for clusters of k: from the commit to StartCluster at the last member and to every
    member running; every member's StartCluster to running, each cluster's slowest, its spread
    and its submission to its last member running."""
    ts = [t for t in trials if t["k"] == k]
    running = [[m["running"] * 1000 for m in t["members"]] for t in ts]
    starts = [[(m["running"] - m["received"]) * 1000 for m in t["members"]] for t in ts]
    last_received = [max(m["received"] for m in t["members"]) * 1000 for t in ts]
    return {
        "start_cluster": [at - t["commit"] * 1000 for t, at in zip(ts, last_received, strict=True)],
        "running": [max(r) - t["commit"] * 1000 for t, r in zip(ts, running, strict=True)],
        "member": [ms for s in starts for ms in s],
        "slowest": [max(s) for s in starts],
        "spread": [max(r) - min(r) for r in running],
        "submitted": [max(r) - t["submitted"] * 1000 for t, r in zip(ts, running, strict=True)],
    }


def size_table(trials: list[dict], sizes: tuple, columns: tuple) -> tuple[str, dict]:
    """The table of each size's percentiles, and each (key, p)'s worst (value, size)."""
    per = {k: by_size(trials, k) for k in sizes}
    got = {
        k: {(key, p): common.percentile(x[key], p) for _, key, p in columns} for k, x in per.items()
    }
    rows = [[k, len(per[k]["running"]), *(f"{v:.1f}" for v in got[k].values())] for k in sizes]
    header = " | ".join(["members | clusters", *(name for name, _, _ in columns)])
    worst = {kp: max((got[k][kp], k) for k in sizes) for kp in got[sizes[0]]}
    return common.table(header, rows), worst


def worst_figure(figure: str, limit: float, worst: tuple[float, int]) -> common.Figure:
    return common.below(figure, limit, worst[0], note=f" ({worst[1]} members)")


def start_figures(worst: dict) -> list[common.Figure]:
    figure = "gang start on agents: commit to every member running, {} (worst of 2, 3, 4 members)"
    return [
        worst_figure(figure.format("median"), START_MEDIAN_MS, worst["running", 50]),
        worst_figure(figure.format("p95"), START_P95_MS, worst["running", 95]),
    ]


def agent_figures(worst: dict) -> list[common.Figure]:
    over = "worst of 2, 4, 8 members"
    return [
        worst_figure(
            f"agent: spread between a cluster's first and last member process start, median"
            f" ({over})",
            SPREAD_TARGET_MS,
            worst["spread", 50],
        ),
        worst_figure(
            f"agent: every member's process running after its StartCluster, median of the"
            f" slowest ({over})",
            AGENT_START_MS,
            worst["slowest", 50],
        ),
    ]


SUSTAINED_HEADER = " | ".join(
    [
        "clusters queued | members timed | member starts/s",
        *(f"{name}, ms per member" for name in (*CONTROL, "agents")),
        "control plane | whole system",
    ]
)


def per_member(r: dict) -> dict[str, float]:
    ms = {k: v * 1000 / r["members"] for k, v in r["cpu"].items()}
    ms["control"] = sum(ms[k] for k in CONTROL)
    ms["whole"] = ms["control"] + ms["agents"]
    return ms


def sustained_rows(runs: list[dict]) -> list[list]:
    rows = []
    for r in runs:
        cells = [f"{per_member(r)[k]:.1f}" for k in (*CONTROL, "agents", "control", "whole")]
        rows.append([r["queued"], r["members"], f"{r['members'] / r['secs']:.1f}", *cells])
    return rows


def sustained_figures(runs: list[dict]) -> list[common.Figure]:
    shallow, deep = per_member(runs[0]), per_member(runs[-1])
    found = [
        common.below(
            f"deep cluster queue: control plane CPU per member start, {runs[0]['queued']}"
            " clusters of 3 queued on 8 agents",
            CONTROL_MS,
            shallow["control"],
        ),
        common.below(
            "deep cluster queue: the whole system's CPU per member start, agents included",
            WHOLE_MS,
            shallow["whole"],
        ),
    ]
    if len(runs) > 1:
        ratio = deep["whole"] / shallow["whole"]
        found.append(
            common.Figure(
                f"deep cluster queue: CPU per member start at {runs[-1]['queued']} clusters"
                f" queued against {runs[0]['queued']}",
                f"within {FLAT_SHARE:.0%}",
                f"{deep['whole']:.1f} against {shallow['whole']:.1f} ms ({ratio:.2f}x)",
                abs(ratio - 1) <= FLAT_SHARE,
            )
        )
    return found


IDLE_HEADER = " | ".join(
    ["connected | seconds", *(f"{n}, ms/s" for n in CONTROL), "control plane, ms/s"]
)


def idle_rows(out: dict) -> list[list]:
    rows = []
    labels = {
        "idle": f"{AGENTS} agents",
        "simulated": f"{out['simulated_count']} reference workers",
    }
    for key, label in labels.items():
        if r := out.get(key):
            per = [r["cpu"][k] * 1000 / r["secs"] for k in CONTROL]
            rows.append([label, f"{r['secs']:.0f}", *(f"{x:.2f}" for x in per), f"{sum(per):.2f}"])
    return rows


def main() -> None:
    parser = common.parser(__doc__, DATABASE_URL, REDIS_DB, settle_load=1.5)
    parser.add_argument("--only", default="idle,start,sustained", help="parts: " + ",".join(PARTS))
    parser.add_argument("--trials", type=int, default=30, help="gang-start clusters per size")
    parser.add_argument("--agent-trials", type=int, default=100, help="agent: clusters per size")
    parser.add_argument("--queued", default="100,1000", help="sustained: clusters queued")
    parser.add_argument("--window", type=int, default=300, help="sustained: members timed")
    parser.add_argument("--idle-secs", type=float, default=30.0)
    parser.add_argument("--simulated", type=int, default=1000, help="idle reference workers")
    parser.add_argument("--profile", metavar="PY_SPY", help="log statements, record py-spy")
    args = parser.parse_args()
    args.only = args.only.split(",")
    args.queued = common.parse_ints(args.queued)
    args.redis_port = common.free_port()
    # The stack's Redis is a server of the script's own, so that its CPU is the stack's alone:
    # every process, this one too, is pointed at it.
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{args.redis_port}/0"
    common.start(args)
    common.raise_open_files(args.simulated)
    out = run(args)
    crashes = common.crash_fact(len(out["crashes"]), out["tracebacks"])
    crashed = bool(out["crashes"])
    if "agent" in out:
        table, worst = size_table(out["agent"], AGENT_SIZES, AGENT_COLUMNS)
        jobs = sum(t["k"] for t in out["agent"])
        facts = [
            f"Agent CPU: {out['agent_cpu'] * 1000 / jobs:.1f} ms per job ({jobs} jobs).",
            f"{crashes} Agent log lines at level error: {out['agent_errors']}.",
        ]
        load = f"{out['load'][0]} at the start, {out['agent_load']} at the end"
        common.finish(args, "agent", AGENT_SECTION, table, facts, agent_figures(worst), load=load)
        crashed = crashed or bool(out["agent_errors"])
    tables, found = [], []
    if "trials" in out:
        table, worst = size_table(out["trials"], SIZES, START_COLUMNS)
        tables.append(table)
        found += start_figures(worst)
    if "sustained" in out:
        tables.append(common.table(SUSTAINED_HEADER, sustained_rows(out["sustained"])))
        found += sustained_figures(out["sustained"])
    if "idle" in out:
        tables.append(common.table(IDLE_HEADER, idle_rows(out)))
        ms = sum(out["idle"]["cpu"][k] for k in CONTROL) * 1000 / out["idle"]["secs"]
        figure = f"idle: control plane CPU with {AGENTS} connected idle agents"
        found.append(common.below(figure, IDLE_MS, ms, unit="ms/s"))
    if tables:
        load = f"{', '.join(out['load'])}, at the start and after each depth"
        common.finish(
            args, "gang-start-agents", SECTION, "\n\n".join(tables), [crashes], found, load=load
        )
    sys.exit(1 if crashed else 0)


if __name__ == "__main__":
    main()
