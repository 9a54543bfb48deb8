#!/usr/bin/env python3
"""The README demo's FarSkip-overlapped HybridEP run against the demo's
HybridEP run of an earlier build, measured in interleaved pairs on this
machine.

A ratio of two step times measured minutes apart on a shared 2-core machine
says little (its speed drifts 10-50% between periods), so this bench builds
the earlier revision's `xdmoe` from this repository's history, then runs the
two in turn, alternating which goes first, and reports each pair's ratio.
Both runs are real `xdmoe launch`es of the built-in demo (2 DCs x 2 workers,
the inter-DC link shaped to 100 Mbit/s and 10 ms, 30 steps).

The default baseline, 1eeada5, is the last revision before overlap existed:
every step ran compute, then communication, and its demo's HybridEP run
(`--mode auto`) was its best.

usage: python3 bench/demo_vs_baseline.py [--baseline REV] [--pairs 3]
           [--baseline-mode auto] [--mode auto+farskip] [--xdmoe build/xdmoe]
           [--work runs/demo_vs_baseline] [--out bench/results]
Writes <out>/demo_vs_baseline.csv and .txt. The baseline's build (about
4 minutes on 2 cores) is kept in <work>/src-<REV> and reused.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kw)


def build_baseline(rev, work):
    """Exports `rev` from this repository's history and builds its xdmoe."""
    full = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", rev + "^{commit}"], capture_output=True,
                          text=True)
    if full.returncode != 0:
        sys.exit(f"unknown revision {rev!r}: {full.stderr.strip()} (this bench needs the repository's history)")
    sha = full.stdout.strip()
    src = os.path.join(work, "src-" + sha[:12])
    exe = os.path.join(src, "build", "xdmoe")
    if os.path.exists(exe):
        print(f"baseline {sha[:12]}: reusing {exe}", flush=True)
        return sha, exe
    os.makedirs(src, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", REPO, "archive", sha], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", src], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        sys.exit(f"cannot export {sha[:12]} into {src}")
    print(f"baseline {sha[:12]}: building xdmoe in {src}/build (about 4 minutes on 2 cores)", flush=True)
    for cmd in (["cmake", "-S", src, "-B", os.path.join(src, "build")],
                ["cmake", "--build", os.path.join(src, "build"), "-j2", "--target", "xdmoe"]):
        out = run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"building the baseline failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return sha, exe


def launch(xdmoe, mode, run_dir):
    """One demo run; returns its summary."""
    out = run([xdmoe, "launch", "--mode", mode, "--run-dir", run_dir], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{xdmoe} launch --mode {mode} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    with open(os.path.join(run_dir, mode, "summary.json")) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="1eeada5", help="the earlier revision (default: the last before overlap)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--baseline-mode", default="auto", help="the baseline's run (its demo's HybridEP run)")
    p.add_argument("--mode", default="auto+farskip", help="this build's run (the demo's FarSkip-overlapped run)")
    p.add_argument("--xdmoe", default=os.path.join(REPO, "build", "xdmoe"))
    p.add_argument("--work", default=os.path.join(REPO, "runs", "demo_vs_baseline"))
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    a = p.parse_args()
    if a.pairs < 1:
        sys.exit("--pairs must be at least 1")
    if not os.access(a.xdmoe, os.X_OK):
        sys.exit(f"{a.xdmoe} is not an executable; build it first (README)")
    os.makedirs(a.work, exist_ok=True)
    sha, base_exe = build_baseline(a.baseline, os.path.abspath(a.work))
    rows = []
    for i in range(1, a.pairs + 1):
        order = ["baseline", "this"] if i % 2 else ["this", "baseline"]  # alternate: drift cancels
        got = {}
        for who in order:
            exe, mode = (base_exe, a.baseline_mode) if who == "baseline" else (a.xdmoe, a.mode)
            got[who] = launch(exe, mode, os.path.join(a.work, f"pair{i}-{who}"))
        b, t = got["baseline"], got["this"]
        row = {
            "pair": i,
            "first": order[0],
            "baseline_step_ms": 1e3 * b["mean_step_s"],
            "baseline_domains": "x".join(map(str, b["domain_sizes"])),
            "baseline_loss": b["final_loss"],
            "step_ms": 1e3 * t["mean_step_s"],
            "domains": "x".join(map(str, t["domain_sizes"])),
            "pipeline_degree": t.get("pipeline_degree", ""),
            "step_over_bound": t.get("step_over_bound", float("nan")),
            "step_over_cpu_floor": t.get("step_over_cpu_floor", float("nan")),
            "fwd_overlap_percent": t.get("fwd_overlap_percent", float("nan")),
            "bwd_overlap_percent": t.get("bwd_overlap_percent", float("nan")),
            "loss": t["final_loss"],
        }
        row["speedup"] = row["baseline_step_ms"] / row["step_ms"]
        rows.append(row)
        print(f"pair {i}: baseline {row['baseline_step_ms']:.1f} ms ({row['baseline_domains']}), "
              f"this build {row['step_ms']:.1f} ms ({row['domains']}, step / bound {row['step_over_bound']:.2f}): "
              f"{row['speedup']:.2f}x", flush=True)

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "demo_vs_baseline.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    speedups = [r["speedup"] for r in rows]
    lines = [
        f"baseline {sha[:12]} --mode {a.baseline_mode} against this build's --mode {a.mode}, {len(rows)} interleaved pairs",
        "pair  first     baseline ms  dom   this ms  dom   r  step/bound  step/cpu  overlap fwd/bwd  speedup",
    ]
    for r in rows:
        lines.append(f"{r['pair']:>4}  {r['first']:<8} {r['baseline_step_ms']:>12.1f}  {r['baseline_domains']:<4}"
                     f"{r['step_ms']:>8.1f}  {r['domains']:<4}{r['pipeline_degree']!s:>2}  {r['step_over_bound']:>10.2f}"
                     f"  {r['step_over_cpu_floor']:>8.2f}  {r['fwd_overlap_percent']:>7.0f} / {r['bwd_overlap_percent']:<5.0f}"
                     f"  {r['speedup']:>6.2f}x")
    mean_ratio = statistics.mean(r["baseline_step_ms"] for r in rows) / statistics.mean(r["step_ms"] for r in rows)
    lines.append(f"speedup: median {statistics.median(speedups):.2f}x, ratio of the means {mean_ratio:.2f}x, "
                 f"range {min(speedups):.2f}-{max(speedups):.2f}x; final losses: baseline "
                 f"{rows[0]['baseline_loss']:.4f}, this build {rows[0]['loss']:.4f}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "demo_vs_baseline.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
