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
import sys

from sr_loss_bench import plot_curves  # one seed's curves CSV -> PNG


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
                         "the <csv>_curves.csv beside each per-seed CSV; the mean curves go to <png>_curves.csv")
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
    """The seeds' mean loss at every step, per run, as a curves CSV beside the
    PNG, drawn as bench/sr_loss_bench.py draws one seed's."""
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
                    key = (name, int(r["step"]))
                    sums[key] = sums.get(key, 0.0) + float(r[name])
                    counts[key] = counts.get(key, 0) + 1
            seen.update(new)
    names = [n for n in names if any(k[0] == n for k in sums)]
    steps = sorted({k[1] for k in sums if all((n, k[1]) in sums for n in names)})
    curve_path = a.png[:-4] + "_curves.csv"
    with open(curve_path, "w") as f:
        f.write("step," + ",".join(names) + "\n")
        for step in steps:
            f.write("%d,%s\n" % (step, ",".join("%.6f" % (sums[(n, step)] / counts[(n, step)]) for n in names)))
    plot_curves(curve_path, a.png, names)
    print("wrote %s and %s (the mean of %d seeds)" % (curve_path, a.png, len(parse_seeds(a.seeds))))


if __name__ == "__main__":
    main()
