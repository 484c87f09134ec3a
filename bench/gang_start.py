"""Gang start on real agents, a deep queue of clusters, and a connected fleet's idle cost.

    .venv/bin/python bench/gang_start.py [--trials N] [--queued 100,1000] [--window 300]
                                         [--idle-secs S] [--simulated N] [--only PART]
                                         [--profile PY_SPY] [--write docs/benchmarks.md]

Parts: idle (8 agents, then --simulated reference workers), start (clusters of 2, 3, 4 onto
idle agents), sustained (each --queued depth of clusters of 3). --profile PY_SPY (with --only
sustained) logs every statement of the bench database and records py-spy on daphne and Celery,
and prints what it found; the figures then carry that overhead. The method is in
docs/benchmarks.md, "Gang start on agents and a deep cluster queue".
"""

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _common as common
from bench import agent as agents

REDIS_DB = 6
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/gradient_bench_gang"
SECTION = "## Gang start on agents and a deep cluster queue"
BENCH = "gang-start-agents"
AGENTS = 8
SIZES = (2, 3, 4)
START_MEDIAN_MS, START_P95_MS = 35.0, 50.0
CONTROL_MS, WHOLE_MS, FLAT_SHARE, IDLE_MS = 10.0, 25.0, 0.10, 8.0
MEMBER_SECS = 0.3
CONTROL = ("daphne", "celery worker", "beat", "postgres", "redis")
PG_LOG = Path("/var/log/postgresql/postgresql-15-main.log")


class Stack:
    """Redis, daphne, Celery and the agents, on the bench database."""

    def __init__(self, tmp: Path, redis_port: int):
        self.tmp = tmp
        self.procs = common.Processes(common.process_env(), tmp / "logs")
        redis = self.procs.start("redis", "redis-server", "--port", str(redis_port), "--save", "")
        common.until(lambda: redis.poll() is None and listening(redis_port), 30.0, "Redis")
        self.workers = agents.make_workers(AGENTS, tmp)
        self.names = [name for name, _ in self.workers]
        self.url = self.procs.url

    def start(self) -> None:
        self.procs.daphne()
        self.procs.celery()
        self.agents = agents.start_agents(self.procs, self.url, self.workers, self.tmp)

    def stop_agents(self) -> None:
        for proc, _ in self.procs.procs:
            if proc.pid in self.agents:
                self.procs.kill(proc, signal.SIGTERM)

    def meter(self) -> common.CpuMeter:
        p = self.procs.pids
        groups = {"daphne": p("daphne"), "celery worker": p("celery-worker")}
        groups |= {"beat": p("celery-beat"), "redis": p("redis")}
        return common.CpuMeter(groups, exclude_backends=[backend_pid()])

    def agents_cpu(self) -> float:
        return sum(common.cpu_secs(pid, children=False) for pid in self.agents)


def listening(port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def backend_pid() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


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
    common.until(lambda: connected_count("idle-") == count, 120.0, f"{count} connected", 0.5)
    time.sleep(10.0)  # past the connect storm and each one's first resend
    return measured(stack, lambda: time.sleep(secs))


def connected_count(prefix: str) -> int:
    from workers.models import Worker

    return Worker.objects.filter(name__startswith=prefix, channel_name__isnull=False).count()


# Gang start


def gang_trials(stack: Stack, trials: int) -> list[dict]:
    """Clusters of each size one at a time, each with the time of its commit."""
    from clusters import submission

    starts = stack.tmp / "starts"
    starts.mkdir()
    files = {k: agents.cluster_file(k, starts, stack.tmp) for k in SIZES}
    commits: list[float] = []
    wake = submission.wake_dispatch

    def marked_wake():  # run on commit: the clock starts there
        commits.append(time.time())
        return wake()

    submission.wake_dispatch = marked_wake
    try:
        agents.trial(files[max(SIZES)], starts)  # warm-up, not counted
        results = []
        for k in SIZES:
            for _ in range(trials):
                time.sleep(0.3)  # every agent idle again, its RequestJob answered
                results.append({"k": k, **agents.trial(files[k], starts), "commit": commits[-1]})
    finally:
        submission.wake_dispatch = wake
    received = {
        e["assignment_id"]: datetime.fromisoformat(e["time"]).timestamp()
        for e in agents.agent_events(stack.procs, stack.names)
        if e["event"] == agents.START_EVENT
    }
    for r in results:
        last_start = max(received[m["assignment"]] for m in r["members"])
        r["start_cluster_ms"] = (last_start - r["commit"]) * 1000
        r["running_ms"] = (max(m["running"] for m in r["members"]) - r["commit"]) * 1000
    return results


# Sustained


def submit_all(count: int) -> None:
    from clusters.submission import MemberSpec, submit_cluster
    from gradient.jobs.submission import JobSpec

    job = JobSpec(kind="build", command=["sleep", str(MEMBER_SECS)])
    members = [MemberSpec(role="node", job=job)] * 3
    for _ in range(count):
        submit_cluster(agents.PROJECT, members)


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
        result["statements"] = statements(marks, time.time(), backend_pid())
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
        if args.only in (None, "idle"):
            out["idle"] = idle(stack, args.idle_secs)
        if args.only in (None, "start"):
            out["trials"] = gang_trials(stack, args.trials)
            print(common.table(START_HEADER, start_rows(out["trials"])), flush=True)
        if args.only in (None, "sustained"):
            out["sustained"] = []
            for queued in args.queued:
                out["sustained"].append(sustained(stack, queued, args.window, args.profile))
                out["load"].append(common.load())
                print(common.table(SUSTAINED_HEADER, sustained_rows(out)[-1:]), flush=True)
        if args.only in (None, "idle") and args.simulated:
            out["simulated"] = idle_simulated(stack, args.simulated, args.idle_secs)
        stack.stop_agents()
        out["crashes"], out["tracebacks"] = stack.procs.problems()
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


START_HEADER = (
    "members | clusters | commit to StartCluster at the last member, median ms | p95 ms"
    " | commit to every member running, median ms | p95 ms"
)


def start_rows(trials: list[dict]) -> list[list]:
    rows = []
    for k in SIZES:
        sc = [t["start_cluster_ms"] for t in trials if t["k"] == k]
        run_ = [t["running_ms"] for t in trials if t["k"] == k]
        rows.append([k, len(sc), *(f"{f(xs):.1f}" for xs in (sc, run_) for f in (med, p95))])
    return rows


def med(xs: list[float]) -> float:
    return common.percentile(xs, 50)


def p95(xs: list[float]) -> float:
    return common.percentile(xs, 95)


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


def sustained_rows(out: dict) -> list[list]:
    rows = []
    for r in out["sustained"]:
        ms = per_member(r)
        cells = [f"{ms[k]:.1f}" for k in (*CONTROL, "agents", "control", "whole")]
        rows.append([r["queued"], r["members"], f"{r['members'] / r['secs']:.1f}", *cells])
    return rows


def figures(out: dict) -> list[common.Figure]:
    found = []
    if trials := out.get("trials"):
        worst = {}
        for k in SIZES:
            xs = [t["running_ms"] for t in trials if t["k"] == k]
            worst[k] = (med(xs), p95(xs))
        k1 = max(SIZES, key=lambda k: worst[k][0])
        k2 = max(SIZES, key=lambda k: worst[k][1])
        over = "worst of 2, 3, 4 members"
        found += [
            common.Figure(
                f"gang start on agents: commit to every member running, median ({over})",
                f"< {START_MEDIAN_MS:.0f} ms",
                f"{worst[k1][0]:.1f} ms ({k1} members)",
                worst[k1][0] < START_MEDIAN_MS,
            ),
            common.Figure(
                f"gang start on agents: commit to every member running, p95 ({over})",
                f"< {START_P95_MS:.0f} ms",
                f"{worst[k2][1]:.1f} ms ({k2} members)",
                worst[k2][1] < START_P95_MS,
            ),
        ]
    if runs := out.get("sustained"):
        shallow = per_member(runs[0])
        found += [
            common.Figure(
                f"deep cluster queue: control plane CPU per member start, {runs[0]['queued']}"
                " clusters of 3 queued on 8 agents",
                f"< {CONTROL_MS:.0f} ms",
                f"{shallow['control']:.1f} ms",
                shallow["control"] < CONTROL_MS,
            ),
            common.Figure(
                "deep cluster queue: the whole system's CPU per member start, agents included",
                f"< {WHOLE_MS:.0f} ms",
                f"{shallow['whole']:.1f} ms",
                shallow["whole"] < WHOLE_MS,
            ),
        ]
        if len(runs) > 1:
            deep = per_member(runs[-1])
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
    if r := out.get("idle"):
        ms = sum(r["cpu"][k] for k in CONTROL) * 1000 / r["secs"]
        found.append(
            common.Figure(
                f"idle: control plane CPU with {AGENTS} connected idle agents",
                f"< {IDLE_MS:.0f} ms/s",
                f"{ms:.1f} ms/s",
                ms < IDLE_MS,
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
    parser.add_argument("--trials", type=int, default=30, help="gang-start clusters per size")
    parser.add_argument("--queued", default="100,1000", help="sustained: clusters queued")
    parser.add_argument("--window", type=int, default=300, help="sustained: members timed")
    parser.add_argument("--idle-secs", type=float, default=30.0)
    parser.add_argument("--simulated", type=int, default=1000, help="idle reference workers")
    parser.add_argument("--only", choices=("idle", "start", "sustained"))
    parser.add_argument("--profile", metavar="PY_SPY", help="log statements, record py-spy")
    args = parser.parse_args()
    args.queued = common.parse_ints(args.queued)
    args.redis_port = common.free_port()
    # The stack's Redis is a server of the script's own, so that its CPU is the stack's alone:
    # every process, this one too, is pointed at it.
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{args.redis_port}/0"
    common.start(args)
    common.raise_open_files(args.simulated)
    out = run(args)
    tables = [
        common.table(header, rows())
        for key, header, rows in (
            ("trials", START_HEADER, lambda: start_rows(out["trials"])),
            ("sustained", SUSTAINED_HEADER, lambda: sustained_rows(out)),
            ("idle", IDLE_HEADER, lambda: idle_rows(out)),
        )
        if key in out
    ]
    load = ", ".join(out["load"])
    common.finish(
        args,
        BENCH,
        SECTION,
        "\n\n".join(tables),
        [common.crash_fact(len(out["crashes"]), out["tracebacks"])],
        figures(out),
        load=f"{load}, at the start and after each depth",
        crashed=bool(out["crashes"]),
    )


if __name__ == "__main__":
    main()
