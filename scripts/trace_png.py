#!/usr/bin/env python3
"""Renders xdmoe step traces (Chrome trace JSON, one file per worker) as a PNG
timeline with gnuplot: one row per worker thread, compute in blue, the compute
thread's waits for communication in red, transfers on the comm threads in
green, and one row per shaped link class in grey: when its egress was
transmitting (the gaps are when it idled). The same files open in Perfetto
(ui.perfetto.dev) or chrome://tracing.

  scripts/trace_png.py runs/trace --step 20 --out runs/trace/step20.png

With --idle it draws nothing and prints where the cores idled instead: the
workers' traces of the step aligned on the machine's monotonic clock, the
core time during which fewer compute threads computed than there are cores,
grouped by what the others were waiting for (workers on one machine).

  scripts/trace_png.py runs/trace --step 20 --idle --cores 2

With --layers it prints, per layer and pass, each worker's routed-expert
compute, how much longer the layer's busiest worker computed, and each
worker's waits on that layer's transfers: a wait as long as a peer's extra
expert compute in that layer is the routing's imbalance, not a transfer.

  scripts/trace_png.py runs/trace --step 20 --layers

Traces come from `train.trace_steps` / `train.trace_dir` in the job config,
or `xdmoe launch --trace-steps 20` (docs/overlap.md)."""
import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile

COLORS = {"compute": "0x4C72B0", "wait": "0xC44E52", "comm": "0x55A868", "link": "0x777777"}
LANES = ["compute", "to experts", "to sources", "expert gather / grads", "dense all-reduce"]


def load(paths):
    events, meta, t0 = [], {}, {}
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        for e in trace["traceEvents"]:
            if e.get("ph") == "X":
                events.append(e)
            elif e.get("name") == "thread_name":
                meta[(e["pid"], e["tid"])] = e["args"]["name"]
        other = trace.get("otherData", {})
        if "rank" in other and "steady_t0_s" in other:
            t0[other["rank"]] = other["steady_t0_s"]
    return events, meta, t0


def idle_table(events, t0, cores):
    """Core time with fewer than `cores` compute threads computing, by the
    waits in progress then. A worker computes while one of its compute spans
    is open and none of its waits (which sit inside compute spans) is."""
    base = min(t0.values()) if t0 else 0.0
    spans = []
    for e in events:
        if e.get("cat") not in ("compute", "wait"):
            continue
        shift = (t0.get(e["pid"], base) - base) * 1e6  # to the earliest worker's clock, us
        spans.append((e["pid"], e["ts"] + shift, e["ts"] + e["dur"] + shift, e["name"], e["cat"] == "wait"))
    if not spans:
        sys.exit("trace_png: the traces hold no compute spans")
    cuts = sorted({s[1] for s in spans} | {s[2] for s in spans})
    workers = len({s[0] for s in spans})
    idle, by_waits = 0.0, collections.Counter()
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        open_spans = [s for s in spans if s[1] <= mid < s[2]]
        waiting = {s[0]: s[3] for s in open_spans if s[4]}
        computing = {s[0] for s in open_spans if not s[4]} - set(waiting)
        free = max(0, cores - len(computing))
        if free:
            idle += free * (b - a)
            what = " | ".join(f"w{r}: {w}" for r, w in sorted(waiting.items())) or "(no wait: between spans)"
            by_waits[(len(computing), what)] += free * (b - a)
    length = cuts[-1] - cuts[0]
    lines = [f"{workers} workers on {cores} cores, {length / 1e3:.1f} ms: cores idle {idle / 1e3:.1f} core-ms "
             f"({100 * idle / (cores * length):.1f}% of the cores' time)",
             "idle core-ms  computing  waiting"]
    for (n, what), us in by_waits.most_common(12):
        lines.append(f"{us / 1e3:12.1f}  {n:9d}  {what}")
    return "\n".join(lines)


def layers_table(events):
    """Per layer and pass, each worker's routed-expert compute and its compute
    thread's waits on that layer's transfers. A worker whose experts drew more
    tokens in a layer holds the others' Combine (forward) or backward of
    Dispatch there: the "over" column is how much longer the layer's
    busiest worker computed, which no schedule hides in that layer."""
    routed = collections.defaultdict(float)  # (pass, layer, rank) -> ms
    waits = collections.defaultdict(float)
    for e in events:
        layer = e.get("args", {}).get("layer")
        if layer is None or layer < 0:
            continue
        name = e["name"]
        pass_ = "backward" if "backward" in name else "forward"
        if e.get("cat") == "wait":
            waits[(pass_, layer, e["pid"])] += e["dur"] / 1e3
        elif name in ("routed experts", "routed experts backward"):
            routed[(pass_, layer, e["pid"])] += e["dur"] / 1e3
    ranks = sorted({e["pid"] for e in events})
    keys = sorted({k[:2] for k in list(routed) + list(waits)}, key=lambda k: (k[0] == "backward", k[1]))
    if not keys:
        sys.exit("trace_png: the traces hold no per-layer spans")
    cols = "".join(f"{'w' + str(r):>8}" for r in ranks)
    width = 8 * len(ranks)
    lines = ["experts: routed-expert compute; over: the layer's longest minus this worker's; "
             "waits: on the layer's transfers (ms)",
             f"{'pass':9}{'layer':>5}  {'experts':>{width}}  {'over':>{width}}  {'waits':>{width}}",
             f"{'':14}  {cols}  {cols}  {cols}"]
    total_excess, total_wait = collections.Counter(), collections.Counter()
    for pass_, layer in keys:
        own = [routed.get((pass_, layer, r), 0.0) for r in ranks]
        excess = [max(own) - x for x in own]
        wait = [waits.get((pass_, layer, r), 0.0) for r in ranks]
        for r, x, w in zip(ranks, excess, wait):
            total_excess[r] += x
            total_wait[r] += w
        lines.append(f"{pass_:9}{layer:5d}  " + "".join(f"{x:8.2f}" for x in own) + "  " +
                     "".join(f"{x:8.2f}" for x in excess) + "  " + "".join(f"{x:8.2f}" for x in wait))
    lines.append(f"{'all':14}  {' ' * width}  " + "".join(f"{total_excess[r]:8.2f}" for r in ranks) +
                 "  " + "".join(f"{total_wait[r]:8.2f}" for r in ranks))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a trace directory, or one trace JSON file")
    p.add_argument("--step", type=int, help="the traced step to draw (default: the lowest found)")
    p.add_argument("--out", help="PNG to write (default: <dir>/trace-step<N>.png)")
    p.add_argument("--title", default="", help="a line under the default title")
    p.add_argument("--idle", action="store_true",
                   help="print where the cores idled in the step (no PNG): core time with fewer compute threads "
                        "computing than --cores, by what the others waited for")
    p.add_argument("--cores", type=int, default=os.cpu_count(),
                   help="with --idle: the cores the traced workers shared (default: this machine's)")
    p.add_argument("--layers", action="store_true",
                   help="print, per layer and pass, each worker's routed-expert compute and its waits on that "
                        "layer's transfers (no PNG)")
    a = p.parse_args()
    if a.cores is None or a.cores < 1:
        sys.exit("trace_png: --cores must be at least 1")
    if os.path.isdir(a.trace):
        files = sorted(glob.glob(os.path.join(a.trace, "trace-step*-rank*.json")))
        steps = sorted({int(os.path.basename(f).split("-")[1][4:]) for f in files})
        if not steps:
            sys.exit(f"trace_png: no trace-step*-rank*.json in {a.trace}")
        step = a.step if a.step is not None else steps[0]
        files = [f for f in files if os.path.basename(f).startswith(f"trace-step{step}-")]
        if not files:
            sys.exit(f"trace_png: step {step} was not traced (traced: {steps})")
        out = a.out or os.path.join(a.trace, f"trace-step{step}.png")
    else:
        files, step = [a.trace], None
        out = a.out or os.path.splitext(a.trace)[0] + ".png"
    events, meta, t0 = load(files)
    if not events:
        sys.exit("trace_png: the traces hold no spans")
    if a.layers:
        print((f"step {step}:\n" if step is not None else "") + layers_table(events))
        return
    if a.idle:
        print((f"step {step}: " if step is not None else "") + idle_table(events, t0, a.cores))
        return
    # Every worker's clock starts at its own first span; rows: worker, lane.
    ranks = sorted({e["pid"] for e in events})
    rows = {}
    for r in ranks:
        # The threads' lanes, then the link rows (tids after them).
        for tid in sorted({e["tid"] for e in events if e["pid"] == r}):
            rows[(r, tid)] = len(rows)
    end_ms = max((e["ts"] + e["dur"]) / 1e3 for e in events)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "spans.dat")
        with open(data, "w") as f:
            # Waits last: they sit inside the compute spans they interrupt.
            for e in sorted(events, key=lambda e: e["cat"] == "wait"):
                y = len(rows) - 1 - rows[(e["pid"], e["tid"])]
                x0, x1 = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
                h = 0.35 if e["cat"] != "wait" else 0.2
                f.write(f"{(x0 + x1) / 2} {y} {x0} {x1} {y - h} {y + h} {COLORS.get(e['cat'], '0x888888')}\n")
        labels = ", ".join(f'"w{r} {meta.get((r, t), LANES[t] if t < len(LANES) else "lane " + str(t))}" '
                           f'{len(rows) - 1 - i}' for (r, t), i in rows.items())
        title = f"step {step}" if step is not None else os.path.basename(a.trace)
        if a.title:
            title += "\\n" + a.title
        script = f"""
set terminal pngcairo size 1600,{160 + 34 * len(rows)} font ",10"
set output "{out}"
set title "{title}: compute (blue), compute waiting for communication (red), transfers (green), link transmitting (grey)"
set xlabel "ms since the worker's first span"
set ytics ({labels})
set yrange [-0.7:{len(rows) - 0.3}]
set xrange [0:{end_ms * 1.01}]
set grid xtics
unset key
plot "{data}" using 1:2:3:4:5:6:7 with boxxyerror fs solid 0.85 noborder lc rgb variable
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(out)


if __name__ == "__main__":
    main()
