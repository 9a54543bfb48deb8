#!/usr/bin/env python3
"""Loss impact of expert compression (HybridEP Fig. 14), on this machine.

Trains the 2 DC x 2 worker job of examples/2dc.yaml (the default corpus) as
HybridEP with every expert gathered (domain sizes [2, 2]) for a few hundred
steps, once per codec choice on the inter-DC link:
  raw             nothing compressed
  bf16-gather     experts in bf16 (NMSE ~1e-6): how far a near-lossless change
                  moves the loss, i.e. the noise floor of the comparison
  ep-bf16-tokens  EP (no gathered experts) with token rows in bf16
  topk50          top-k of the expert itself, no base ("w/o S"), ~50x
  sr<R>           the SR codec: top-k of expert - base, + zstd ("w/ S"), ~Rx
  sr<R>-ef        the same with error feedback against what the receivers hold
The experts start alike (model.expert_init_spread, default 0.2 here), as after
sparse upcycling; with --spread 1 they start independent and the base holds
nothing (see docs/compression.md). Links are not shaped: only the loss matters.

usage: python3 bench/sr_loss_bench.py [--xdmoe build/xdmoe] [--steps 200]
           [--spread 0.2] [--runs raw,sr50,...] [--out bench/results]
Writes <out>/sr_loss.csv (one row per run: final loss, mean loss of the last
50 steps, expert-gather bytes and ratio, NMSE), <out>/sr_loss_curves.csv (every
step) and <out>/sr_loss.png (gnuplot).
"""
import argparse
import json
import os
import re
import subprocess
import sys

# name -> dc codecs (and "domains" for a run that is not HybridEP [2, 2]).
# Densities are chosen so that the expert-gather bytes shrink by about the
# ratio in the name (bf16 values and varint indices cost ~2 bytes a kept
# entry); the table reports the measured ratio.
RUNS = {
    "raw": {},
    "bf16-gather": {"expert_gather": "bf16"},  # near-lossless: the run-to-run noise floor
    "ep-bf16-tokens": {"dispatch": "bf16", "combine": "bf16", "domains": "[1, 1]"},
    "topk50": {"expert_gather": "topk:0.04+zstd:1"},
    "sr10": {"expert_gather": "sr:topk:0.2+zstd:1"},
    "sr25": {"expert_gather": "sr:topk:0.08+zstd:1"},
    "sr50": {"expert_gather": "sr:topk:0.04+zstd:1"},
    "sr100": {"expert_gather": "sr:topk:0.02+zstd:1"},
    "sr200": {"expert_gather": "sr:topk:0.01+zstd:1"},
    "sr10-ef": {"expert_gather": "sr:ef:topk:0.2+zstd:1"},
    "sr50-ef": {"expert_gather": "sr:ef:topk:0.04+zstd:1"},
    "sr100-ef": {"expert_gather": "sr:ef:topk:0.02+zstd:1"},
    "sr200-ef": {"expert_gather": "sr:ef:topk:0.01+zstd:1"},
}
TAIL = 50  # steps averaged for the final loss: one step's loss is noisy


def job_yaml(base, run, steps, spread):
    codecs = {k: v for k, v in run.items() if k != "domains"}
    y = base
    y = y.replace("  connectivity: regular", "  connectivity: regular\n  expert_init_spread: %g" % spread)
    y = re.sub(r"steps: \d+", "steps: %d" % steps, y, count=1)
    y = y.replace("log_every: 10", "log_every: 50").replace("eval_every: 30", "eval_every: 0")
    c = ", ".join("%s: '%s'" % kv for kv in codecs.items())
    dc = "link: {bandwidth: 100mbit, latency: 10ms, shape: false%s}" % (", codecs: {%s}" % c if c else "")
    y = y.replace("link: {bandwidth: 100mbit, latency: 10ms, shape: true}", dc, 1)
    y = y.replace("link: {bandwidth: 1gbit, latency: 0.2ms, shape: true}",
                  "link: {bandwidth: 1gbit, latency: 0.2ms, shape: false}")
    y = y.replace("mode: auto ", "mode: hybrid")
    y = y.replace("domain_sizes: [1, 1]", "domain_sizes: %s" % run.get("domains", "[2, 2]"))
    return y


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--spread", type=float, default=0.2)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--work", default="runs/sr_loss_bench")
    a = ap.parse_args()
    base = open(os.path.join(os.path.dirname(__file__), "..", "examples", "2dc.yaml")).read()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    rows, curves = [], {}
    names = a.runs.split(",")
    for i, name in enumerate(names):
        cfg = os.path.join(a.work, name + ".yaml")
        with open(cfg, "w") as f:
            f.write(job_yaml(base, RUNS[name], a.steps, a.spread))
        run_dir = os.path.join(a.work, name)
        print("[%d/%d] %s: %d steps ..." % (i + 1, len(names), name, a.steps), flush=True)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        p = subprocess.run([a.xdmoe, "launch", "--config", cfg, "--run-dir", run_dir],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        summary_path = os.path.join(run_dir, "hybrid", "summary.json")
        if p.returncode != 0 or not os.path.exists(summary_path):
            sys.exit("%s failed:\n%s" % (name, p.stdout[-3000:]))
        s = json.load(open(summary_path))
        losses = s["losses"]
        b = s["bytes_per_step"]
        wire, raw = b.get("dc/expert_gather", 0.0), b.get("dc/expert_gather_raw", 0.0)
        rows.append({
            "run": name,
            "codecs": ";".join("%s=%s" % kv for kv in RUNS[name].items()) or "raw",
            "final_loss": losses[-1],
            "tail_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
            "dc_expert_gather_MB": wire / 1e6,
            "expert_gather_ratio": raw / wire if wire > 0 else 0.0,
            "dc_base_MB": b.get("dc/expert_base", 0.0) / 1e6,
            "dc_total_MB": b.get("dc/total", 0.0) / 1e6,
            "nmse": s.get("mean_nmse", {}).get("dc/expert_gather", 0.0),
        })
        curves[name] = losses
        print("    mean loss of the last %d steps %.4f, expert gather %.1fx, NMSE %.4f" %
              (TAIL, rows[-1]["tail_loss"], rows[-1]["expert_gather_ratio"], rows[-1]["nmse"]), flush=True)
    ref = next((r["tail_loss"] for r in rows if r["run"] == "raw"), None)
    with open(os.path.join(a.out, "sr_loss.csv"), "w") as f:
        keys = list(rows[0].keys()) + ["vs_raw_percent"]
        f.write(",".join(keys) + "\n")
        for r in rows:
            r["vs_raw_percent"] = 100.0 * (r["tail_loss"] / ref - 1) if ref else 0.0
            f.write(",".join(str(round(r[k], 6)) if isinstance(r[k], float) else str(r[k]) for k in keys) + "\n")
    curve_path = os.path.join(a.out, "sr_loss_curves.csv")
    with open(curve_path, "w") as f:
        f.write("step," + ",".join(names) + "\n")
        for step in range(a.steps):
            f.write("%d,%s\n" % (step + 1, ",".join("%.5f" % curves[n][step] for n in names)))
    print("%-15s %10s %10s %9s %9s %8s %9s" % ("run", "last-%d" % TAIL, "vs raw %", "AG ratio", "AG MB", "base MB", "NMSE"))
    for r in rows:
        print("%-15s %10.4f %+10.2f %9.1f %9.3f %8.2f %9.4f" % (r["run"], r["tail_loss"], r["vs_raw_percent"],
              r["expert_gather_ratio"], r["dc_expert_gather_MB"], r["dc_base_MB"], r["nmse"]))
    # Loss curves, smoothed over 10 steps so the codecs can be told apart.
    plot = ",\\\n  ".join("'%s' using 1:(avg%d($%d)) with lines title '%s'" % (curve_path, i, i + 2, n)
                          for i, n in enumerate(names))
    avgs = "\n".join(
        "samples%d(x) = $0 > 9 ? 10 : ($0+1)\nback%d_1 = back%d_2 = back%d_3 = back%d_4 = back%d_5 = back%d_6 = "
        "back%d_7 = back%d_8 = back%d_9 = back%d_10 = 0\nshift%d(x) = (back%d_10 = back%d_9, back%d_9 = back%d_8, "
        "back%d_8 = back%d_7, back%d_7 = back%d_6, back%d_6 = back%d_5, back%d_5 = back%d_4, back%d_4 = back%d_3, "
        "back%d_3 = back%d_2, back%d_2 = back%d_1, back%d_1 = x)\navg%d(x) = (shift%d(x), (back%d_1 + back%d_2 + "
        "back%d_3 + back%d_4 + back%d_5 + back%d_6 + back%d_7 + back%d_8 + back%d_9 + back%d_10) / samples%d($0))"
        % tuple([i] * 44) for i in range(len(names)))
    script = """set terminal pngcairo size 1000,600
set output '%s'
set datafile separator ','
set key autotitle columnhead right top
set title 'Training loss, 2 DC x 2 workers, HybridEP [2,2], expert codec on the inter-DC link (10-step mean)'
set xlabel 'step'
set ylabel 'loss'
set yrange [*:*]
%s
plot %s
""" % (os.path.join(a.out, "sr_loss.png"), avgs, plot)
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print("wrote %s/sr_loss.csv, %s and %s/sr_loss.png" % (a.out, curve_path, a.out))


if __name__ == "__main__":
    main()
