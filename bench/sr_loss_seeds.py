#!/usr/bin/env python3
"""Loss impact over several seeds: the per-seed CSVs of bench/sr_loss_bench.py
gathered into one table of each run's gap to raw, with its mean and standard
error.

One 300-step run of the loss bench is chaotic: the same codec on another seed
moves its gap to raw by a percent or more, so a 1% target needs several seeds
and a standard error beside the mean (bench/README.md, "Loss impact of expert
compression").

usage: python3 bench/sr_loss_seeds.py --seeds 1-6
           --csv 'bench/results/sr_loss_heldout_seed{S}.csv'
           --csv 'bench/results/sr_loss_block16_seed{S}.csv' [--runs a,b]
           [--out bench/results/NAME.csv] [--png bench/results/NAME.png]
Each --csv is a pattern with {S} for the seed. For each seed, the rows of all
its files are pooled; the seed's "raw" row (from any of them) is the
reference, and a seed without one is an error. A run missing on some seeds is
averaged over the seeds it has (the n column says how many). Figures are the
mean training loss of the last 50 steps and the held-out loss, in percent
above raw.
"""
import argparse
import csv
import math
import os
import subprocess
import sys


def parse_seeds(text):
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def stats(values):
    n = len(values)
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return mean, se


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", required=True, help="e.g. 1-6 or 1,2,5")
    ap.add_argument("--csv", action="append", required=True, help="a per-seed CSV pattern with {S}")
    ap.add_argument("--runs", default=None, help="only these runs, in this order")
    ap.add_argument("--out", default=None, help="also write the table as CSV here")
    ap.add_argument("--png", default=None,
                    help="also plot each run's loss curve, averaged over the seeds, beside raw's (gnuplot), from "
                         "the <csv>_curves.csv beside each per-seed CSV")
    a = ap.parse_args()
    gaps = {}  # run -> list of (seed, last-50 %, held-out %)
    order = []
    for seed in parse_seeds(a.seeds):
        rows = {}
        for pattern in a.csv:
            path = pattern.replace("{S}", str(seed))
            if not os.path.exists(path):
                continue
            for r in csv.DictReader(open(path)):
                rows.setdefault(r["run"], r)
        if "raw" not in rows:
            sys.exit("seed %d: no raw run in %s" % (seed, ", ".join(p.replace("{S}", str(seed)) for p in a.csv)))
        raw = rows["raw"]
        for name, r in rows.items():
            if name == "raw":
                continue
            if name not in gaps:
                order.append(name)
            held = float(r["held_out_loss"])
            gaps.setdefault(name, []).append((
                seed, 100.0 * (float(r["tail_loss"]) / float(raw["tail_loss"]) - 1),
                100.0 * (held / float(raw["held_out_loss"]) - 1) if held > 0 else float("nan"),
                float(r["expert_gather_ratio"])))
    names = a.runs.split(",") if a.runs else order
    out_rows = []
    print("%-24s %3s %8s %13s %13s %17s" % ("run", "n", "AG ratio", "last-50 %", "held-out %", "per seed (last-50)"))
    for name in names:
        if name not in gaps:
            sys.exit("run '%s' is in none of the CSVs" % name)
        g = gaps[name]
        tail_mean, tail_se = stats([x[1] for x in g])
        held = [x[2] for x in g if not math.isnan(x[2])]
        held_mean, held_se = stats(held) if held else (float("nan"), float("nan"))
        ratio = sum(x[3] for x in g) / len(g)
        per_seed = " ".join("%d:%+.2f" % (x[0], x[1]) for x in g)
        print("%-24s %3d %7.1fx %+6.2f +-%4.2f %+6.2f +-%4.2f  %s" % (name, len(g), ratio, tail_mean, tail_se,
                                                                    held_mean, held_se, per_seed))
        out_rows.append([name, len(g), round(ratio, 2), round(tail_mean, 3), round(tail_se, 3), round(held_mean, 3),
                         round(held_se, 3), per_seed])
    print("+- is the standard error of the mean over the seeds")
    if a.out:
        with open(a.out, "w") as f:
            w = csv.writer(f)
            w.writerow(["run", "seeds", "expert_gather_ratio", "vs_raw_percent", "vs_raw_se", "held_out_vs_raw_percent",
                        "held_out_vs_raw_se", "per_seed"])
            w.writerows(out_rows)
        print("wrote " + a.out)
    if a.png:
        plot_mean_curves(a, ["raw"] + names)


def plot_mean_curves(a, names):
    """The seeds' mean loss at every step (10-step running mean), per run."""
    sums, counts = {}, {}
    for seed in parse_seeds(a.seeds):
        seen = set()
        for pattern in a.csv:
            path = pattern.replace("{S}", str(seed))[:-4] + "_curves.csv"
            if not os.path.exists(path):
                continue
            reader = csv.DictReader(open(path))
            new = [n for n in names if n in reader.fieldnames and n not in seen]  # a run once per seed
            for r in reader:
                for name in new:
                    step = int(r["step"])
                    sums[(name, step)] = sums.get((name, step), 0.0) + float(r[name])
                    counts[(name, step)] = counts.get((name, step), 0) + 1
            seen.update(new)
    steps = sorted({k[1] for k in sums})
    dat = a.png[:-4] + ".dat"
    with open(dat, "w") as f:
        for i, step in enumerate(steps):
            cols = []
            for name in names:
                window = [sums[(name, s)] / counts[(name, s)] for s in steps[max(0, i - 9):i + 1] if (name, s) in sums]
                cols.append("%.5f" % (sum(window) / len(window)) if window else "NaN")
            f.write("%d %s\n" % (step, " ".join(cols)))
    n = len(parse_seeds(a.seeds))
    plots = ", ".join("'%s' using 1:%d with lines lw 2 title '%s'" % (dat, j + 2, name) for j, name in enumerate(names))
    script = """set terminal pngcairo size 1400,600
set output '%s'
set multiplot layout 1,2 title 'Training loss, mean of %d seeds (10-step running mean), 2 DC x 2 workers, HybridEP [2,2]'
set xlabel 'step'
set ylabel 'loss'
set grid
plot %s
set xrange [%d:*]
plot %s
unset multiplot
""" % (a.png, n, plots, steps[len(steps) // 2] if steps else 0, plots)
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print("wrote " + a.png)


if __name__ == "__main__":
    main()
