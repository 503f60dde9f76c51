"""The PNG plots of docs/benchmarks.md, drawn from the benches' --json results (matplotlib).

Each ``plot_*`` takes one bench's result dict and a path, writes a small PNG
(about 100 dpi, few colours) and returns the path.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on a server; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"unbound": "#c0504d", "daemon": "#1f77b4", "pool": "#9bbb59", "irqs": "#8064a2", "host": "#f79646"}
LABELS = {"unbound": "unbound", "daemon": "bound (daemon, role split)", "pool": "pool only (no role split)",
          "irqs": "bound, isolation = irqs", "host": "bound, isolation = host"}
DPI = 90


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_effect_latency(effect: dict, path: str) -> str:
    """Step latency per arm: share of steps per bin, and the tail (share of steps slower than x)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm, r in effect["arms"].items():
        edges, counts = r["histogram"]["edges_us"], r["histogram"]["counts"]
        total = sum(counts) or 1
        ax1.stairs([c / total for c in counts], edges, color=COLOURS[arm], label=LABELS[arm], linewidth=1.4)
        tail, left = [], total
        for c in counts:
            left -= c
            tail.append(left / total)
        xs = edges[1:]
        pairs = [(x, t) for x, t in zip(xs, tail) if t > 0]
        if pairs:
            ax2.step([p[0] for p in pairs], [p[1] for p in pairs], where="post", color=COLOURS[arm],
                     linewidth=1.4, label=LABELS[arm])
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("step latency (us)")
        ax.grid(True, which="major", alpha=0.3)
    ax1.set_ylabel("share of steps")
    ax1.set_title("distribution", fontsize=10)
    ax2.set_yscale("log")
    ax2.set_ylabel("share of steps slower")
    ax2.set_title("tail (p99 at 1e-2, p99.9 at 1e-3)", fontsize=10)
    ax2.axhline(1e-2, color="grey", linewidth=0.6, linestyle=":")
    ax2.axhline(1e-3, color="grey", linewidth=0.6, linestyle=":")
    ax1.legend(fontsize=8)
    return _save(fig, path)


def plot_effect_threads(effect: dict, path: str) -> str:
    """Migrations and involuntary context switches per second, per role thread and arm."""
    roles = ["main", "acl", "release", "helpers"]
    names = ["main", "acl_thread", "release_thread", "helper (each)"]
    arms = list(effect["arms"])
    panels = [("migrations_per_s", "CPU migrations / s"), ("nonvoluntary_per_s", "involuntary context switches / s")]
    if all("run_delay_ms_per_s" in effect["arms"][a]["threads"]["main"] for a in arms):
        panels.append(("run_delay_ms_per_s", "run-queue delay (ms / s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2))
    width = 0.8 / len(arms)
    for ax, (key, title) in zip(axes, panels):
        for i, arm in enumerate(arms):
            th = effect["arms"][arm]["threads"]
            vals = [th[r][key] / max(1, th[r]["threads"]) for r in roles]
            ax.bar([j + (i - (len(arms) - 1) / 2) * width for j in range(len(roles))], vals, width,
                   color=COLOURS[arm], label=LABELS[arm])
        ax.set_xticks(range(len(roles)), names, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_bind(bind: dict, path: str) -> str:
    """Median bind time per contender (log scale), each run as a dot."""
    order = ["bare", "bind_threads", "apply_plan", "core-no-state", "daemon-core", "daemon", "reference-floor",
             "reference"]
    names = [n for n in order if n in bind["median_ms"]]
    fig, ax = plt.subplots(figsize=(8, 3.0))
    for i, n in enumerate(names):
        colour = "#1f77b4" if n in ("daemon", "apply_plan", "bind_threads") else "#7f7f7f"
        ax.barh(i, bind["median_ms"][n], color=colour, alpha=0.8)
        runs = bind["times_ms"][n]
        ax.plot(runs, [i] * len(runs), "k.", markersize=3, alpha=0.5)
        ax.text(bind["median_ms"][n] * 1.15, i, f"{bind['median_ms'][n]:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"time to bind a {bind['params']['threads']}-thread worker (ms, median; dots: runs)")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def plot_plan(plan: dict, path: str) -> str:
    """Median plan time per host shape (CPUs / NPUs, ascending), per mode, default config."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    rows = [r for r in plan["rows"] if r["config"] == "default"]
    shapes = sorted({(r["cpus"], r["npus"]) for r in rows})
    pos = {shape: i for i, shape in enumerate(shapes)}
    styles = {"topo_affinity": "#1f77b4", "global_slice": "#ff7f0e", "950_cluster": "#2ca02c",
              "topo (overlap)": "#d62728"}
    for mode, colour in styles.items():
        for all_npus, marker, ls in ((False, "o", ":"), (True, "s", "-")):
            pts = sorted((pos[(r["cpus"], r["npus"])], r["median_ms"]) for r in rows
                         if r["mode"] == mode and (r["targets"] == r["npus"]) == all_npus)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=ls, color=colour,
                    markersize=4, label=f"{mode}, {'every NPU' if all_npus else 'one NPU'}")
    ax.axhline(plan["target_ms"], color="grey", linestyle="--", linewidth=0.8)
    ax.text(len(shapes) - 1, plan["target_ms"] * 1.1, f"target {plan['target_ms']:.0f} ms at 4096 CPUs / 128 NPUs",
            fontsize=8, ha="right")
    ax.set_xticks(range(len(shapes)), [f"{c} / {n}" for c, n in shapes], fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("host CPUs / NPUs")
    ax.set_ylabel("make_plan median (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    return _save(fig, path)


def plot_idle(idle: dict, path: str, goal_cpu: float, goal_rss: float) -> str:
    """Idle daemon CPU share and RSS against the threads it holds bound."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    for period, marker in ((5.0, "o"), (1.0, "s")):
        rows = sorted((r for r in idle["rows"] if r["reconcile_seconds"] == period),
                      key=lambda r: r["threads_total"])
        if not rows:
            continue
        xs = [r["threads_total"] for r in rows]
        ax1.plot(xs, [r["cpu_percent"] for r in rows], marker=marker, label=f"reconcile every {period:g} s")
        ax2.plot(xs, [r["rss_mb"] for r in rows], marker=marker, label=f"reconcile every {period:g} s")
        for r in rows:
            ax1.annotate(f"{r['workers']}x{r['threads_per_worker']}", (r["threads_total"], r["cpu_percent"]),
                         fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax1.axhline(goal_cpu, color="grey", linestyle="--", linewidth=0.8)
    ax2.axhline(goal_rss, color="grey", linestyle="--", linewidth=0.8)
    ax1.set_ylabel("CPU (% of one CPU)")
    ax2.set_ylabel("RSS (MB)")
    ax2.set_ylim(0, goal_rss * 1.15)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("bound threads (workers x threads)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)
