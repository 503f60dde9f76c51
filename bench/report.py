"""``make bench``: run every bench, then write docs/benchmarks.md and its plots.

    .venv/bin/python bench/report.py [--quick] [--docs DIR] [--from-json RESULTS]

Runs bench/plan.py, bench/bind.py, bench/effect.py and bench/daemon_idle.py one
after the other, each with ``--json`` (their own output goes to the terminal as
it comes), keeps the raw results in ``DIR/bench/results.json``, draws the PNGs
into ``DIR/bench/`` and writes ``DIR/benchmarks.md`` with the figures, the
machine and the date. Ends with the headline figures and whether each goal was
met. ``--from-json`` redraws the page from a saved results.json without
measuring; ``--quick`` runs every bench briefly (a check that it all works, not
figures to keep). Each bench also runs on its own; see its docstring.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402

GOAL_MIGRATION_CUT = 90.0
GOAL_IDLE_CPU = 0.2
GOAL_IDLE_RSS = 60.0
PNG_LIMIT = 150 * 1024

# bench -> the argument lists it is run with; the rows of several runs are merged
FULL = {
    "plan": [["--repeat", "11"]],
    "bind": [["--runs", "20"]],
    "effect": [["--seconds", "30", "--rounds", "3"]],
    # the goal point gets the long window; the smaller points only draw the curve
    "daemon_idle": [["--points", "1x50,4x200", "--reconcile", "5", "--seconds", "10"],
                    ["--points", "16x200", "--reconcile", "5", "--seconds", "60"]],
}
QUICK = {
    "plan": [["--repeat", "2"]],
    "bind": [["--runs", "2", "--threads", "40"]],
    "effect": [["--seconds", "4", "--rounds", "2"]],
    "daemon_idle": [["--points", "1x20,2x50", "--reconcile", "1", "--seconds", "2"]],
}
PLOTS = ("effect_latency", "effect_threads", "bind", "plan", "daemon_idle")

# ---------------------------------------------------------------- headline figures (pure)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} %"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def idle_goal_row(idle: dict) -> dict | None:
    for r in idle.get("rows", []):
        if (r["workers"], r["threads_per_worker"], r["reconcile_seconds"]) == (16, 200, 5.0):
            return r
    return None


def headlines(results: dict) -> list[str]:
    """The lines `make bench` ends with: each goal, its figure and met / MISSED."""
    out = []
    eff = results.get("effect")
    if eff:
        cut = eff["ratios"]["daemon"]["migration_cut"]
        if cut is None:
            out.append("role-thread migrations: the unbound arm did not migrate at all; no cut measurable")
        else:
            verdict = "met" if 100 * cut >= GOAL_MIGRATION_CUT else "MISSED"
            out.append(f"bound role threads (main, acl_thread, release_thread) migrate {100 * cut:.1f} % less than "
                       f"unbound under the neighbour (goal >= {GOAL_MIGRATION_CUT:.0f} %: {verdict})")
        rd, rp = eff["ratios"]["daemon"], eff["ratios"]["pool"]
        out.append(f"p99 step latency bound / unbound = {_x(rd['p99'])} (p50 {_x(rd['p50'])}, "
                   f"p99.9 {_x(rd['p99.9'])}, steps/s {_x(rd['steps_per_s'])}); pool only / unbound p99 = "
                   f"{_x(rp['p99'])}")
    idle = results.get("daemon_idle")
    row = idle_goal_row(idle) if idle else None
    if row:
        cpu_ok = row["cpu_percent"] < GOAL_IDLE_CPU
        rss_ok = row["rss_mb"] < GOAL_IDLE_RSS
        out.append(f"idle daemon, 16 workers x 200 threads, reconcile 5 s: CPU {row['cpu_percent']:.3f} % of one CPU "
                   f"(goal < {GOAL_IDLE_CPU} %: {'met' if cpu_ok else 'MISSED'}), RSS {row['rss_mb']:.1f} MB "
                   f"(goal < {GOAL_IDLE_RSS:.0f} MB: {'met' if rss_ok else 'MISSED'})")
        out.append(f"one reconcile pass over {row['threads_total']} threads: {row['pass_ms']:.1f} ms wall "
                   f"({row['pass_us_per_thread']:.2f} us per thread), {row['cpu_ms_per_pass']:.1f} ms CPU "
                   f"({row['cpu_us_per_thread']:.2f} us per thread)")
    elif idle:
        out.append("idle daemon: the 16 x 200, 5 s point was not measured in this run")
    return out


# ---------------------------------------------------------------- the page (pure)


def _effect_section(eff: dict) -> list[str]:
    p, arms, rat = eff["params"], eff["arms"], eff["ratios"]
    plan = eff["plan"]

    def cl(xs):
        return ",".join(map(str, xs)) or "-"

    lines = [
        "## What binding buys",
        "",
        f"`bench/effect.py`: a stand-in worker with the real one's shape (a main thread handing small steps of "
        f"{p['work']} arithmetic iterations to an `acl_thread` over a pipe and waiting for each, a `release_thread` "
        f"poked every 8 steps, {p['helpers']} helper threads waking every millisecond) under a noisy neighbour "
        f"({p['neighbour']}) that keeps every CPU busy. Three arms, alternated over {p['rounds']} rounds, "
        f"{p['seconds']:g} s measured each: **unbound**; **bound** by ascendbind through the daemon "
        f"(POST /v1/bind with the worker's pid); **pool only**, every thread on the NPU's whole pool with no role "
        f"split (no config key turns the split off, so the bench sets those masks itself with sched_setaffinity).",
        "",
        f"Plan for NPU {p['npu']}: pool {cl(plan['pool'])}, main {cl(plan['main'])}, acl {cl(plan['acl'])}, "
        f"release {cl(plan['release'])}"
        + (" (fixture host: one NPU whose affinity is every CPU here, with `small_pool = share`)."
           if p.get("fixture_host") else "."),
        "",
        "| | unbound | bound (daemon) | pool only | bound / unbound | pool / unbound |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(label, get, key, fmt):
        vals = " | ".join(fmt.format(get(arms[a])) for a in ("unbound", "daemon", "pool"))
        lines.append(f"| {label} | {vals} | {_x(rat['daemon'][key])} | {_x(rat['pool'][key])} |")

    row("steps / s", lambda r: r["steps_per_s"], "steps_per_s", "{:.0f}")
    for k in ("p50", "p99", "p99.9"):
        row(f"step latency {k} (us)", lambda r, k=k: r["latency_us"][k], k, "{:.1f}")
    names = {"main": "main", "acl": "acl_thread", "release": "release_thread",
             "helpers": f"{p['helpers']} helpers"}
    for role in ("main", "acl", "release", "helpers"):
        row(f"migrations / s, {names[role]}", lambda r, role=role: r["threads"][role]["migrations_per_s"],
            f"migrations_{role}", "{:.2f}")
    for role in ("main", "acl", "release", "helpers"):
        row(f"involuntary switches / s, {names[role]}",
            lambda r, role=role: r["threads"][role]["nonvoluntary_per_s"], f"nonvoluntary_{role}", "{:.1f}")
    totals = ", ".join(f"{a} {sum(arms[a]['threads'][r]['migrations'] for r in ('main', 'acl', 'release'))}"
                       for a in ("unbound", "daemon", "pool"))
    steps = ", ".join(f"{a} {arms[a]['steps']}" for a in ("unbound", "daemon", "pool"))
    lines += [
        "",
        f"Role-thread migrations in all (main + acl_thread + release_thread): {totals}. Steps measured: {steps}.",
        "",
        "![step latency, bound vs unbound](bench/effect_latency.png)",
        "",
        "![migrations and involuntary switches per thread](bench/effect_threads.png)",
        "",
        "What this shows and what it does not: the stand-in is Python, and its steps hand the GIL between "
        "threads; the waits are `os.read` on pipes and `time.sleep`, which release it, so a step's latency is "
        "two thread wake-ups plus a few microseconds of work. It measures the scheduler (where and how soon a "
        "woken thread runs next to a CPU hog), not an NPU: published vllm-ascend figures for Ascend binding "
        "come from real inference. Where the NPU's pool is every CPU (the fixture host), *pool only* sets the "
        "same masks as *unbound*, so their difference is run-to-run noise.",
        "",
        "Reading the figures: the role split puts `acl_thread` on other CPUs than the main thread, so every "
        "bound step is a cross-CPU wake-up, and with a neighbour on every CPU that wake-up has to displace the "
        "neighbour; unbound, the woken thread may run on the CPU its waker is leaving. Look at the median and "
        "the tail separately: binding trades where each wake-up may land for a fixed place, and the "
        "involuntary switches of the bound threads show how often they were still pushed off it.",
        "",
    ]
    return lines


def _bind_section(bind: dict) -> list[str]:
    med = bind["median_ms"]
    cpu = bind.get("median_cpu_ms") or {}
    lines = [
        "## Bind latency: the daemon against the in-process floor",
        "",
        f"`bench/bind.py`: one worker of {bind['params']['threads']} named threads bound again and again, "
        f"contenders alternated, {bind['params']['runs']} runs each. `bare` is the floor: the same /proc reads "
        "and sched_setaffinity calls with no ascendbind code. `daemon` is POST /v1/bind end to end (socket, "
        "the worker's one observation, plan, the four steps, state file); `daemon-core` the same bind "
        "in-process; `core-no-state` a diagnostic row, `daemon-core` without the state-file write (it only "
        "shows the file's share); `round-trip` a GET /v1/health, what the socket, HTTP and client cost a "
        "request doing no work. `reference` is a script-based binder's per-worker subprocess path with the "
        "fixture npu-smi; `reference-floor` the same with `npu-smi` replaced by `true`. CPU is the binder's "
        "CPU per bind (for `daemon`, the client's plus every daemon thread's): on a loaded box the wall clock "
        "of a multi-millisecond bind is mostly time spent waiting to run.",
        "",
        "| contender | median (ms) | min | CPU (ms) | wall / bare | CPU / bare |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("bare", "bind_threads", "apply_plan", "core-no-state", "daemon-core", "daemon", "round-trip",
                 "reference-floor", "reference"):
        if name in med:
            runs = bind["times_ms"][name]
            has_cpu = name in cpu and name not in ("round-trip", "reference-floor", "reference")
            c = f"{cpu[name]:.2f}" if has_cpu else "—"
            c_ratio = f"{cpu[name] / cpu['bare']:.1f}x" if has_cpu and cpu.get("bare") else "—"
            ratio = f"{med[name] / med['bare']:.1f}x" if name != "round-trip" else "—"
            lines.append(f"| {name} | {med[name]:.2f} | {min(runs):.2f} | {c} | {ratio} | {c_ratio} |")
    if "daemon" in med:
        lines += ["", f"daemon / bare {med['daemon'] / med['bare']:.1f}x (goal 1.5x), reference / daemon "
                      f"{med['reference'] / med['daemon']:.1f}x (goal 10x)."]
        if "daemon-core" in med and "core-no-state" in med:
            lines[-1] += (f" The state file costs {med['daemon-core'] - med['core-no-state']:.2f} ms a bind; "
                          f"socket, HTTP and client {(cpu.get('daemon', 0) - cpu.get('daemon-core', 0)):.2f} ms "
                          "of CPU.")
        if "round-trip" in med and "bind_threads" in med:
            least = med["bind_threads"] + med["round-trip"]
            lines += ["", f"The floor's work in ascendbind's code (`bind_threads`) plus an empty request's round "
                          f"trip is {least:.2f} ms, {least / med['bare']:.1f}x the floor: no bind over the socket "
                          "costs less, before the daemon has authorized, planned or written its state."]
    if bind.get("daemon_server_mean_ms") is not None:
        lines += ["", f"Of the daemon's time, {bind['daemon_server_mean_ms']:.2f} ms (mean) is spent inside it per "
                      "bind, by its own `ascendbind_bind_duration_seconds`; the rest is the socket, HTTP and the "
                      "client."]
    rec = bind.get("reconcile")
    if rec:
        lines += ["", f"The reconcile pass costs {rec['cached_us_per_thread']:.2f} µs of CPU per bound thread "
                      f"({rec['workers']} workers of {rec['threads_per_worker']} threads, back to back)."]
    lines += ["", "![bind latency](bench/bind.png)", ""]
    return lines


def _plan_section(plan: dict) -> list[str]:
    verdict = "met" if plan["worst_ms"] < plan["target_ms"] else "missed"
    return [
        "## Plan time against host size",
        "",
        f"`bench/plan.py`: `make_plan` on synthetic hosts of 192 to 4096 CPUs, median of "
        f"{plan['params']['repeat']} runs. Slowest case at 4096 CPUs / 128 NPUs with the default config: "
        f"{plan['worst_ms']:.2f} ms (target < {plan['target_ms']:.0f} ms: {verdict}).",
        "",
        "![plan time vs CPUs](bench/plan.png)",
        "",
    ]


def _idle_section(idle: dict) -> list[str]:
    lines = [
        "## Daemon cost at scale",
        "",
        "`bench/daemon_idle.py`: a real daemon (fixture one-NPU host, `allow_shared_npu`) holding W bound "
        "workers of T threads, measured idle. CPU is the daemon's run time from schedstat (ns) over a window "
        "that starts just after a pass and holds whole reconcile periods, charged to those periods, summed "
        "over the daemon's threads, which carry their names (reconcile, memory-locality, api, ...); pass time "
        "is the daemon's own "
        "`ascendbind_reconcile_duration_seconds` (wall clock, so on a busy host it includes time spent "
        "preempted); CPU per pass is the window's CPU divided by its passes.",
        "",
        "| workers x threads | bound threads | reconcile (s) | window (s) | CPU (% of one) | RSS (MB) | passes "
        "| pass (ms) | pass / thread (us) | CPU / pass (ms) | CPU / thread (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in idle["rows"]:
        lines.append(f"| {r['workers']} x {r['threads_per_worker']} | {r['threads_total']} | "
                     f"{r['reconcile_seconds']:g} | {r['window_s']:.0f} | {r['cpu_percent']:.3f} | {r['rss_mb']:.1f} | {r['passes']:g} | "
                     f"{r['pass_ms']:.2f} | {r['pass_us_per_thread']:.2f} | {r['cpu_ms_per_pass']:.2f} | "
                     f"{r['cpu_us_per_thread']:.2f} |")
    row = idle_goal_row(idle)
    if row:
        lines += ["", f"Goals at 16 x 200 with the default 5 s period: CPU < {GOAL_IDLE_CPU} % of one CPU, "
                      f"RSS < {GOAL_IDLE_RSS:.0f} MB. With the kernel's process events "
                      f"({row.get('reconcile_mode', 'events')} mode in this run) a pass that finds no event "
                      "queued and no worker exited (one poll) reads only its share of the masks "
                      "(sched_getaffinity): every worker's main, ACL and release threads and one in "
                      "`drift_sweep_passes` of the others; any other pass reads every thread's mask, a `comm` "
                      "only for a thread born or renamed, and in listing mode one thread count per worker and a "
                      "small staggered share of names. So idle CPU grows with the bound threads: at 5 s, 0.2 % of "
                      f"a CPU allows 10 ms per pass, about {10e3 / row['threads_total']:.1f} us per thread at "
                      f"{row['threads_total']} threads, the memory locality rounds included (amortized over "
                      "`memory_check_seconds`). On a "
                      "virtual machine the figure swings with the host: `bench/daemon_idle.py --before DIR "
                      "--listing` runs the previous code and the listing fallback beside this one, and "
                      "[daemon.md](daemon.md#what-it-costs) keeps such runs."]
        split = row.get("cpu_percent_by_thread")
        if split:
            lines += ["", "Where the idle CPU goes at that point, per daemon thread (% of one CPU): "
                      + ", ".join(f"{name} {pct:.3f}" for name, pct in split.items() if pct >= 0.0005)
                      + (f"; the process's own tick counters say {row['cpu_percent_ticks']:.3f} in all "
                         "(10 ms grain, threads that ended included)" if "cpu_percent_ticks" in row else "")
                      + "."]
    lines += ["", "![daemon idle CPU and RSS](bench/daemon_idle.png)", ""]
    return lines


def render_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` (bench/report.py) on {m['date']}: {m['nproc']} CPUs ({m['cpu_model']}, "
        f"{m['arch']}), kernel {m['kernel']}, Python {m['python']}, load average {m['loadavg'][0]:.2f} at the "
        "start. One run on one machine: rerun `make bench` on your own host for your figures. Every bench also "
        "runs on its own (`.venv/bin/python bench/<name>.py --help`)."
        + (" The load average was above the CPU count: other work competed with every figure below, so read "
           "them as rough." if m["loadavg"][0] > m["nproc"] else ""),
        "",
        "Headline figures:",
        "",
        *[f"* {h}" for h in headlines(results)],
        "",
    ]
    if "effect" in results:
        lines += _effect_section(results["effect"])
    if "bind" in results:
        lines += _bind_section(results["bind"])
    if "plan" in results:
        lines += _plan_section(results["plan"])
    if "daemon_idle" in results:
        lines += _idle_section(results["daemon_idle"])
    return "\n".join(lines).rstrip() + "\n"


def _sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(what precedes the first ``## `` heading, [(heading line, the section's text)])."""
    head, out = [], []
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            out.append((line.strip(), [line]))
        elif out:
            out[-1][1].append(line)
        else:
            head.append(line)
    return "".join(head), [(h, "".join(body)) for h, body in out]


def keep_written_by_hand(page: str, old: str) -> str:
    """``page`` with the sections of the ``old`` page that ``make bench`` does not write
    (the figures of benches run on their own, written up by hand) kept where they were:
    the old page's order, each generated section replaced by its new text, new ones last."""
    head, fresh = _sections(page)
    new = dict(fresh)
    _, before = _sections(old)
    out, used = [head], set()
    for heading, text in before:
        if heading in new:
            text = new[heading]
            used.add(heading)
        out.append(text if text.endswith("\n\n") else text.rstrip("\n") + "\n\n")
    out += [text.rstrip("\n") + "\n\n" for heading, text in fresh if heading not in used]
    return "".join(out).rstrip() + "\n"


# ---------------------------------------------------------------- running and drawing


def run_bench(name: str, runs: list[list[str]], tmp: str) -> dict:
    merged: dict = {}
    for i, extra in enumerate(runs):
        result = _run_one(name, extra, os.path.join(tmp, f"{name}-{i}.json"))
        if not merged:
            merged = result
        else:
            merged["rows"] = merged.get("rows", []) + result.get("rows", [])
    return merged


def _run_one(name: str, extra: list[str], path: str) -> dict:
    argv = [sys.executable, str(ROOT / "bench" / f"{name}.py"), *extra, "--json", path]
    print(f"\n=== bench/{name}.py {' '.join(extra)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=str(ROOT))
    if proc.returncode != 0:
        raise SystemExit(f"bench/{name}.py failed with status {proc.returncode}")
    print(f"=== bench/{name}.py took {time.monotonic() - t0:.0f} s", flush=True)
    with open(path) as fh:
        return json.load(fh)


def draw(results: dict, out_dir: Path) -> list[Path]:
    from bench import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    if "effect" in results:
        made.append(plots.plot_effect_latency(results["effect"], str(out_dir / "effect_latency.png")))
        made.append(plots.plot_effect_threads(results["effect"], str(out_dir / "effect_threads.png")))
    if "bind" in results:
        made.append(plots.plot_bind(results["bind"], str(out_dir / "bind.png")))
    if "plan" in results:
        made.append(plots.plot_plan(results["plan"], str(out_dir / "plan.png")))
    if "daemon_idle" in results:
        made.append(plots.plot_idle(results["daemon_idle"], str(out_dir / "daemon_idle.png"), GOAL_IDLE_CPU,
                                    GOAL_IDLE_RSS))
    return [Path(p) for p in made]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs: checks the pipeline, figures not kept")
    ap.add_argument("--docs", help="where benchmarks.md and bench/ go (default: docs/, or a temporary "
                                   "directory with --quick)")
    ap.add_argument("--from-json", help="redraw from a saved results.json instead of measuring")
    ap.add_argument("--only", help="comma list of benches to run (plan,bind,effect,daemon_idle)")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is missing: pip install -e '.[bench]' (make bench does)", file=sys.stderr)
        return 2
    if args.docs:
        docs = Path(args.docs)
    elif args.quick:
        docs = Path(tempfile.mkdtemp(prefix="ascendbind-bench-quick-"))
    else:
        docs = ROOT / "docs"
    if args.from_json:
        with open(args.from_json) as fh:
            results = json.load(fh)
    else:
        plan = QUICK if args.quick else FULL
        names = args.only.split(",") if args.only else list(plan)
        results = {"machine": machine()}
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ascendbind-report-") as tmp:
            for name in names:
                results[name] = run_bench(name, plan[name], tmp)
        results["wall_s"] = time.monotonic() - t0
        (docs / "bench").mkdir(parents=True, exist_ok=True)
        with open(docs / "bench" / "results.json", "w") as fh:
            json.dump(results, fh, indent=1)
    pngs = draw(results, docs / "bench")
    page = docs / "benchmarks.md"
    old = page.read_text() if page.exists() else ""
    page.write_text(keep_written_by_hand(render_markdown(results), old))
    print("\n=== summary")
    for line in headlines(results):
        print(line)
    for p in pngs:
        size = p.stat().st_size
        if size > PNG_LIMIT:
            print(f"warning: {p} is {size // 1024} KiB (limit {PNG_LIMIT // 1024} KiB)")
    print(f"wrote {docs / 'benchmarks.md'} and {len(pngs)} plots in {docs / 'bench'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
