#!/usr/bin/env python3
"""xdmoe's experiment suite: the published comparisons, run on this system.

usage: scripts/experiments.sh NAME [--xdmoe build/xdmoe] [--out bench/results/experiments]
                                   [--runs runs/experiments] [--steps N] [--quick] [NAME's options]
NAME:
  table5                EP vs HybridEP over inter-DC bandwidth and token size
                        (HybridEP Table V)
  expert-size           EP vs HybridEP as the experts grow (HybridEP Fig. 13)
  planner               the planner's predicted step against the measured one,
                        every domain candidate (HybridEP Fig. 11)
  bandwidth-for-target  the inter-DC bandwidth a target step time needs:
                        predicted by the planner, then run on links shaped to it
  all                   every experiment above, one after another
  list                  the experiments and what they write

Every job is a real `xdmoe launch`: a coordinator and 4 worker processes (2
DCs of 2 workers) over loopback, the links shaped in the workers. Figures are
means over the steps after two warm-up steps. Each experiment writes
<out>/<name>.csv and <out>/<name>.png (gnuplot), keeps its jobs' configs, logs
and summaries under <runs>/<name>/, prints a summary table and a headline,
and takes under 10 minutes on a 2-core machine with the defaults (--quick:
fewer points).
Progress goes to stderr, one line per job with the ETA of the experiment.
"""
import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two models. SMALL, the model of HybridEP Table V at our scale (d = 64, 2
# MoE layers of 8 experts), for the sweeps over token and expert size; DEMO,
# the README demo's (d = 128, 4 MoE layers, a shared expert), whose steps are
# long enough that the links, not fixed per-message costs, set the step time:
# for the planner and the bandwidth experiments.
SMALL = dict(hidden=64, layers=2, shared=0, shared_ff=64)
DEMO = dict(hidden=128, layers=4, shared=1, shared_ff=256)

MODEL = """model:
  hidden_size: {hidden}
  num_layers: {layers}
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 64
  num_experts: 8
  top_k: 2
  expert_intermediate_size: {ff}
  num_shared_experts: {shared}
  shared_intermediate_size: {shared_ff}
  aux_loss_coef: 0.01
train:
  steps: {steps}
  batch_size: {batch}
  seq_len: 64
  warmup_steps: 2
  log_every: 100
  eval_every: 0
data:
  builtin_bytes: 262144
cluster:
  levels:
    - name: dc
      size: 2
      link: {{bandwidth: {bw}, latency: {lat}, shape: true}}
    - name: worker
      size: 2
      link: {{bandwidth: 1gbit, latency: 0.1ms, shape: true}}
  expert_parallel:
    mode: auto
    memory_cap: unlimited
    pipeline_degree: 1
  security:
    insecure: true   # network namespaces of this one machine
"""


def fail(msg):
    sys.stderr.write(f"experiments: {msg}\n")
    sys.exit(2)


class Progress:
    """One stderr line per job: [k/N] what, and the experiment's ETA."""

    def __init__(self, name, total):
        self.name, self.total, self.done, self.start = name, total, 0, time.time()

    def next(self, what):
        eta = ""
        if self.done:
            left = (time.time() - self.start) / self.done * (self.total - self.done)
            eta = f" (ETA {int(left) // 60}m{int(left) % 60:02d}s)"
        self.done += 1
        sys.stderr.write(f"[{self.done}/{self.total}] {self.name}: {what}{eta}\n")
        sys.stderr.flush()


def mbit(rate):
    """'100mbit' -> 100.0, '1gbit' -> 1000.0"""
    r = rate.lower()
    for unit, f in (("gbit", 1000.0), ("mbit", 1.0), ("kbit", 1e-3)):
        if r.endswith(unit):
            return float(r[: -len(unit)]) * f
    fail(f"bad rate {rate!r} (e.g. 100mbit)")


class Suite:
    def __init__(self, args):
        self.xdmoe = os.path.abspath(args.xdmoe)
        if not os.access(self.xdmoe, os.X_OK):
            fail(f"{self.xdmoe} is not an executable; build first (cmake --build build -j2) or pass --xdmoe")
        if not shutil.which("gnuplot"):
            fail("gnuplot is missing: bash scripts/install-deps.sh installs it (gnuplot-nox)")
        self.out = os.path.abspath(args.out)
        self.runs = os.path.abspath(args.runs)
        self.steps = args.steps
        self.quick = args.quick
        os.makedirs(self.out, exist_ok=True)

    def launch(self, name, tag, config, runs):
        """Runs `xdmoe launch` of `runs` on `config`; returns {run: summary}."""
        run_dir = os.path.join(self.runs, name, tag)
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "job.yaml")
        with open(path, "w") as f:
            f.write(config)
        # One plan per job (--no-replan): each row is one plan's measurement.
        cmd = [self.xdmoe, "launch", "--config", path, "--run-dir", run_dir, "--no-probe", "--no-replan",
               "--cli-bind", "tcp://127.0.0.1:*"]
        for r in runs:
            cmd += ["--mode", r]
        with open(os.path.join(run_dir, "launch.log"), "w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        out = {}
        for r in runs:
            try:
                with open(os.path.join(run_dir, r, "summary.json")) as f:
                    out[r] = json.load(f)
            except (OSError, ValueError):
                out[r] = {"ok": False}
        if code != 0:
            sys.stderr.write(f"  a run failed (exit {code}); see {run_dir}/launch.log\n")
        return out

    def plan(self, config):
        """`xdmoe plan --json --no-probe` of a config."""
        path = os.path.join(self.out, "plan.yaml")
        with open(path, "w") as f:
            f.write(config)
        res = subprocess.run([self.xdmoe, "plan", "--config", path, "--json", "--no-probe"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"xdmoe plan failed: {res.stderr.strip()}")
        return json.loads(res.stdout)

    def write_csv(self, name, rows):
        path = os.path.join(self.out, f"{name}.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        return path

    def gnuplot(self, name, script, data):
        """Writes <name>.dat (blocks separated by two blank lines) and <name>.png."""
        dat = os.path.join(self.out, f"{name}.dat")
        with open(dat, "w") as f:
            # gnuplot's `index` counts blocks separated by two blank lines.
            f.write("\n\n\n".join("\n".join(" ".join(str(v) for v in row) for row in block) for block in data) + "\n")
        png = os.path.join(self.out, f"{name}.png")
        full = f'set terminal pngcairo size 900,560 font ",10"\nset output "{png}"\n' + script.replace("DATA", dat)
        res = subprocess.run(["gnuplot"], input=full, capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"gnuplot failed on {name}: {res.stderr.strip()}")
        return png


def ms(s, key):
    v = s.get(key)
    return round(v * 1e3, 1) if isinstance(v, (int, float)) else ""


def ratio(s):
    if s.get("bound_s") and s.get("mean_step_s"):
        return round(s["mean_step_s"] / s["bound_s"], 2)
    return ""


def print_table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))


def table5(suite, args):
    """EP vs the planner's HybridEP over bandwidth x token size."""
    bws = args.bandwidths.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if suite.quick:
        bws, batches = bws[:2], batches[::2]
    p = Progress("table5", len(bws) * len(batches))
    rows = []
    for bw in bws:
        for batch in batches:
            p.next(f"inter-DC {bw}, batch {batch} ({batch * 64} tokens/worker): ep, auto")
            cfg = MODEL.format(**SMALL, ff=64, steps=suite.steps, batch=batch, bw=bw, lat="5ms")
            res = suite.launch("table5", f"{bw}-b{batch}", cfg, ["ep", "auto"])
            ep, hy = res["ep"], res["auto"]
            speedup = round(ep["mean_step_s"] / hy["mean_step_s"], 2) if ep.get("mean_step_s") and hy.get("mean_step_s") else ""
            rows.append({"dc_mbit": mbit(bw), "batch": batch, "tokens_per_worker": batch * 64,
                         "token_kb_per_a2a": round(batch * 64 * 2 * 64 * 4 / 1e3, 1),
                         "ep_step_ms": ms(ep, "mean_step_s"), "ep_step_over_bound": ratio(ep),
                         "ep_overlap_pct": round(ep.get("overlap_percent", 0)),
                         "hybrid_domains": "x".join(map(str, hy.get("domain_sizes", []))),
                         "hybrid_step_ms": ms(hy, "mean_step_s"), "hybrid_step_over_bound": ratio(hy),
                         "hybrid_overlap_pct": round(hy.get("overlap_percent", 0)),
                         "speedup": speedup})
    csv_path = suite.write_csv("table5", rows)
    blocks = [[(r["tokens_per_worker"], r["speedup"]) for r in rows if r["dc_mbit"] == mbit(bw) and r["speedup"] != ""]
              for bw in bws]
    plot = "set title \"EP step time / HybridEP step time (the planner's domains), 2 DCs x 2 workers\"\n" \
           "set xlabel 'tokens per worker per step'\nset ylabel 'speedup over EP'\nset logscale x 2\n" \
           "set key top left\nset grid\n" \
           "plot " + ", ".join(f"'DATA' index {i} using 1:2 with linespoints lw 2 title 'inter-DC {bw}'"
                               for i, bw in enumerate(bws)) + ", 1 with lines dt 2 lc 'gray' title 'EP'\n"
    png = suite.gnuplot("table5", plot, blocks)
    print_table(["dc Mbit/s", "tokens", "EP ms", "step/bound", "HybridEP", "ms", "step/bound", "overlap %", "speedup"],
                [[r["dc_mbit"], r["tokens_per_worker"], r["ep_step_ms"], r["ep_step_over_bound"], r["hybrid_domains"],
                  r["hybrid_step_ms"], r["hybrid_step_over_bound"], r["hybrid_overlap_pct"], r["speedup"]] for r in rows])
    best = max((r for r in rows if r["speedup"] != ""), key=lambda r: r["speedup"], default=None)
    if best:
        print(f"\nheadline: HybridEP {best['speedup']}x faster than EP at {best['dc_mbit']:g} Mbit/s and "
              f"{best['tokens_per_worker']} tokens/worker (domains {best['hybrid_domains']})")
    print(f"wrote {csv_path} and {png}")


def expert_size(suite, args):
    """EP vs the planner's HybridEP as the experts grow (token data fixed)."""
    ffs = [int(f) for f in args.ff.split(",")]
    if suite.quick:
        ffs = ffs[::2]
    p = Progress("expert-size", len(ffs))
    rows = []
    for ff in ffs:
        p.next(f"expert intermediate size {ff}: ep, auto")
        cfg = MODEL.format(**SMALL, ff=ff, steps=suite.steps, batch=args.batch, bw=args.bandwidth, lat="5ms")
        res = suite.launch("expert-size", f"ff{ff}", cfg, ["ep", "auto"])
        ep, hy = res["ep"], res["auto"]
        rows.append({"expert_ff": ff, "expert_kb": round(3 * 64 * ff * 4 / 1e3, 1),
                     "ep_step_ms": ms(ep, "mean_step_s"), "ep_step_over_bound": ratio(ep),
                     "hybrid_domains": "x".join(map(str, hy.get("domain_sizes", []))),
                     "hybrid_step_ms": ms(hy, "mean_step_s"), "hybrid_step_over_bound": ratio(hy),
                     "hybrid_overlap_pct": round(hy.get("overlap_percent", 0)),
                     "speedup": round(ep["mean_step_s"] / hy["mean_step_s"], 2)
                     if ep.get("mean_step_s") and hy.get("mean_step_s") else ""})
    csv_path = suite.write_csv("expert-size", rows)
    plot = f"set title 'Step time as the experts grow (inter-DC {args.bandwidth}, {args.batch * 64} tokens/worker)'\n" \
           "set xlabel 'parameters per expert (KB)'\nset ylabel 'step time (ms)'\nset logscale x 2\nset grid\n" \
           "set key top left\n" \
           "plot 'DATA' index 0 using 1:2 with linespoints lw 2 title 'EP', " \
           "'DATA' index 0 using 1:3 with linespoints lw 2 title \"HybridEP (the planner's domains)\"\n"
    png = suite.gnuplot("expert-size", plot, [[(r["expert_kb"], r["ep_step_ms"] or 0, r["hybrid_step_ms"] or 0)
                                               for r in rows]])
    print_table(["ff", "expert KB", "EP ms", "step/bound", "HybridEP", "ms", "step/bound", "speedup"],
                [[r["expert_ff"], r["expert_kb"], r["ep_step_ms"], r["ep_step_over_bound"], r["hybrid_domains"],
                  r["hybrid_step_ms"], r["hybrid_step_over_bound"], r["speedup"]] for r in rows])
    first, last = rows[0], rows[-1]
    print(f"\nheadline: HybridEP vs EP {first['speedup']}x at {first['expert_kb']} KB experts, "
          f"{last['speedup']}x at {last['expert_kb']} KB")
    print(f"wrote {csv_path} and {png}")


def planner(suite, args):
    """Every domain candidate, predicted against measured."""
    settings = [("100mbit", "10ms"), ("1gbit", "1ms")]
    candidates = ["ep", "hybrid+d1x2", "hybrid+d2x1", "hybrid+d2x2"]
    if suite.quick:
        settings = settings[:1]
    p = Progress("planner", len(settings))
    rows = []
    for bw, lat in settings:
        p.next(f"inter-DC {bw}, {lat}: {', '.join(candidates)}")
        cfg = MODEL.format(**DEMO, ff=256, steps=suite.steps, batch=8, bw=bw, lat=lat)
        res = suite.launch("planner", f"{bw}", cfg, candidates)
        for c in candidates:
            s = res[c]
            if not s.get("mean_step_s"):
                continue
            rows.append({"dc_mbit": mbit(bw), "dc_latency": lat, "run": c,
                         "domains": "x".join(map(str, s.get("domain_sizes", []))),
                         "measured_ms": ms(s, "mean_step_s"), "predicted_ms": ms(s, "predicted_step_s"),
                         "predicted_with_measured_compute_ms": ms(s, "predicted_with_measured_compute_s"),
                         "step_over_bound": ratio(s), "overlap_pct": round(s.get("overlap_percent", 0))})
    if not rows:
        fail("every planner run failed; see " + os.path.join(suite.runs, "planner"))
    for r in rows:
        r["error_pct"] = round(100 * (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"], 1)
        r["error_measured_compute_pct"] = round(
            100 * (r["predicted_with_measured_compute_ms"] - r["measured_ms"]) / r["measured_ms"], 1) \
            if r["predicted_with_measured_compute_ms"] != "" else ""
    csv_path = suite.write_csv("planner", rows)
    hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.1
    plot = "set title 'Planner: predicted vs measured step time, every domain candidate'\n" \
           "set xlabel 'measured (ms)'\nset ylabel 'predicted (ms)'\nset grid\nset key top left\n" \
           f"set xrange [0:{hi}]\nset yrange [0:{hi}]\n" \
           "plot 'DATA' index 0 using 1:2 with points pt 7 ps 1.5 title 'start-up prediction', " \
           "'DATA' index 0 using 1:3 with points pt 5 ps 1.5 title 'with the measured compute', " \
           "x with lines dt 2 lc 'gray' title 'exact'\n"
    png = suite.gnuplot("planner", plot, [[(r["measured_ms"], r["predicted_ms"],
                                            r["predicted_with_measured_compute_ms"] or r["predicted_ms"]) for r in rows]])
    print_table(["dc", "run", "domains", "measured ms", "predicted", "err %", "w/ meas. compute", "err %",
                 "step/bound"],
                [[f"{r['dc_mbit']:g}M", r["run"], r["domains"], r["measured_ms"], r["predicted_ms"], r["error_pct"],
                  r["predicted_with_measured_compute_ms"], r["error_measured_compute_pct"], r["step_over_bound"]]
                 for r in rows])
    errs = [abs(r["error_measured_compute_pct"]) for r in rows if r["error_measured_compute_pct"] != ""]
    raw = [abs(r["error_pct"]) for r in rows]
    # Does the planner's ranking pick the measured best of each setting?
    picks = []
    for bw, lat in settings:
        sub = [r for r in rows if r["dc_mbit"] == mbit(bw)]
        if sub:
            picks.append(min(sub, key=lambda r: r["predicted_ms"])["run"] == min(sub, key=lambda r: r["measured_ms"])["run"])
    print(f"\nheadline: mean |error| {sum(raw) / len(raw):.1f}% at start-up, "
          f"{sum(errs) / max(1, len(errs)):.1f}% with the measured compute; "
          f"the predicted best is the measured best in {sum(picks)} of {len(picks)} settings")
    print(f"wrote {csv_path} and {png}")


def bandwidth_for_target(suite, args):
    """The least inter-DC bandwidth whose planned step meets a target; then checked."""
    def cfg(bw_mbit, steps):
        return MODEL.format(**DEMO, ff=256, steps=steps, batch=8, bw=f"{bw_mbit:.3f}mbit", lat="5ms")

    def predicted(bw_mbit):
        j = suite.plan(cfg(bw_mbit, suite.steps))
        return j["candidates"][j["chosen"]]["iteration_s"]

    p = Progress("bandwidth-for-target", 3)
    p.next("the planner's step time over bandwidth")
    curve = [(bw, predicted(bw)) for bw in (5, 10, 20, 50, 100, 200, 500, 1000, 5000)]
    floor = curve[-1][1]
    target = args.target_ms / 1e3 if args.target_ms else 1.3 * floor
    if target <= floor:
        fail(f"a target of {target * 1e3:.1f} ms is below the step at 5 Gbit/s ({floor * 1e3:.1f} ms): no bandwidth meets it")
    lo, hi = 1.0, 5000.0  # Mbit/s: predicted(lo) > target >= predicted(hi), by bisection in log space
    if predicted(lo) <= target:
        hi = lo
    for _ in range(14):
        if hi / lo < 1.02:
            break
        mid = (lo * hi) ** 0.5
        if predicted(mid) <= target:
            hi = mid
        else:
            lo = mid
    need = hi
    p.next(f"a job on links shaped to {need:.1f} Mbit/s (predicted {predicted(need) * 1e3:.1f} ms)")
    res = suite.launch("bandwidth-for-target", "at-need", cfg(need, suite.steps), ["auto"])["auto"]
    p.next(f"a job at half that, {need / 2:.1f} Mbit/s, for contrast")
    half = suite.launch("bandwidth-for-target", "at-half", cfg(need / 2, suite.steps), ["auto"])["auto"]
    rows = [{"dc_mbit": round(need, 2), "target_ms": round(target * 1e3, 1), "predicted_ms": round(predicted(need) * 1e3, 1),
             "measured_ms": ms(res, "mean_step_s"), "with_measured_compute_ms": ms(res, "predicted_with_measured_compute_s"),
             "step_over_bound": ratio(res), "domains": "x".join(map(str, res.get("domain_sizes", [])))},
            {"dc_mbit": round(need / 2, 2), "target_ms": round(target * 1e3, 1),
             "predicted_ms": round(predicted(need / 2) * 1e3, 1), "measured_ms": ms(half, "mean_step_s"),
             "with_measured_compute_ms": ms(half, "predicted_with_measured_compute_s"), "step_over_bound": ratio(half),
             "domains": "x".join(map(str, half.get("domain_sizes", [])))}]
    csv_path = suite.write_csv("bandwidth-for-target", rows)
    with open(os.path.join(suite.out, "bandwidth-for-target-curve.csv"), "w") as f:
        f.write("dc_mbit,predicted_ms\n" + "".join(f"{bw},{t * 1e3:.2f}\n" for bw, t in curve))
    plot = f"set title 'Inter-DC bandwidth for a {target * 1e3:.0f} ms step (planner, then measured)'\n" \
           "set xlabel 'inter-DC bandwidth (Mbit/s)'\nset ylabel 'step time (ms)'\nset logscale xy\nset grid\n" \
           f"plot 'DATA' index 0 using 1:2 with linespoints lw 2 title 'predicted (the planner)', " \
           f"{target * 1e3} with lines dt 2 lc 'red' title 'target', " \
           "'DATA' index 1 using 1:2 with points pt 7 ps 2 lc 'black' title 'measured'\n"
    png = suite.gnuplot("bandwidth-for-target", plot,
                        [[(bw, t * 1e3) for bw, t in curve], [(r["dc_mbit"], r["measured_ms"] or 0) for r in rows]])
    print_table(["dc Mbit/s", "target ms", "predicted", "measured", "w/ meas. compute", "step/bound", "domains"],
                [[r["dc_mbit"], r["target_ms"], r["predicted_ms"], r["measured_ms"], r["with_measured_compute_ms"],
                  r["step_over_bound"], r["domains"]] for r in rows])
    m = rows[0]["measured_ms"]
    if m != "":
        print(f"\nheadline: a {target * 1e3:.0f} ms step needs {need:.1f} Mbit/s between the DCs (planner); "
              f"measured there: {m} ms ({100 * (m - target * 1e3) / (target * 1e3):+.0f}% of the target)")
    print(f"wrote {csv_path} and {png}")


def fig17(suite, args):
    """HybridEP Fig. 17 by simulation: bench/fig17_simulation.py (xdmoe simulate on SimGrid)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fig17_simulation.py"), "--xdmoe", args.xdmoe,
                        "--out", args.out], cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"fig17 failed ({r.returncode})")
    for ext in ("csv", "txt", "png"):
        src = os.path.join(args.out, f"fig17_simulation.{ext}")
        if os.path.exists(src):
            os.replace(src, os.path.join(args.out, f"fig17.{ext}"))
    print(f"wrote {os.path.join(args.out, 'fig17.csv')} and {os.path.join(args.out, 'fig17.png')}")


EXPERIMENTS = {
    "table5": (table5, "EP vs HybridEP over inter-DC bandwidth x token size"),
    "expert-size": (expert_size, "EP vs HybridEP as the experts grow"),
    "planner": (planner, "predicted vs measured step time, every domain candidate"),
    "bandwidth-for-target": (bandwidth_for_target, "the bandwidth a target step time needs, checked"),
    "fig17": (fig17, "HybridEP over EP from 10 to 1000 DCs, simulated on SimGrid beside the planner"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=list(EXPERIMENTS) + ["all", "list"])
    ap.add_argument("--xdmoe", default=os.path.join(ROOT, "build", "xdmoe"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "experiments"),
                    help="where the CSVs and PNGs go")
    ap.add_argument("--runs", default=os.path.join(ROOT, "runs", "experiments"),
                    help="where each job's config, logs and summaries go")
    ap.add_argument("--steps", type=int, default=12, help="steps per job (the first two are warm-up)")
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--bandwidths", default="20mbit,100mbit,1gbit", help="table5: inter-DC rates")
    ap.add_argument("--batches", default="1,4,16", help="table5: sequences of 64 tokens per worker")
    ap.add_argument("--ff", default="32,128,512", help="expert-size: expert intermediate sizes")
    ap.add_argument("--bandwidth", default="100mbit", help="expert-size: the inter-DC rate")
    ap.add_argument("--batch", type=int, default=4, help="expert-size: sequences of 64 tokens per worker")
    ap.add_argument("--target-ms", type=float, default=0, help="bandwidth-for-target: the step time to meet "
                    "(default: 1.3 x the planned step at 5 Gbit/s)")
    args = ap.parse_args()
    if args.name == "list":
        for name, (_, what) in EXPERIMENTS.items():
            print(f"{name:22s} {what}: <out>/{name}.csv, <out>/{name}.png")
        return
    suite = Suite(args)
    for name in (EXPERIMENTS if args.name == "all" else [args.name]):
        t0 = time.time()
        print(f"== {name}: {EXPERIMENTS[name][1]} ==")
        EXPERIMENTS[name][0](suite, args)
        print(f"({name} took {time.time() - t0:.0f} s)\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
