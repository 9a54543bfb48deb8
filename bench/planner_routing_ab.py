#!/usr/bin/env python3
"""The planner's start-up prediction with the routing probe's A2A imbalance
against the same prediction with uniform routing (F = 1), for every run of
a finished `bench/farskip_overlap.py` (bench/README.md, "The routing's
imbalance at start-up").

For each run it calls `xdmoe plan --json` twice on the run's job and
schedule (its connectivity, schedule and pipeline degrees from the run's
summary): once as the coordinator plans at start-up, and once with the job's
training data pointed at a file that does not exist, so the probe is skipped
and F = 1. Both are compared with the run's measured step. The first call
also gives the same plan with every worker computing as many routed rows
(`even_expert_load_iteration_s`: the routed experts' compute imbalance left
out, the A2As' F kept), a third column. Run it right after the bench, on the
same machine: the probes time the machine as it is.

  python3 bench/planner_routing_ab.py --csv DIR/farskip_overlap.csv --out DIR/routing_ab.txt
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys


def plan_ms(xdmoe, config, flags):
    """The chosen plan's prediction, and the same with even expert loads (ms)."""
    out = subprocess.run([xdmoe, "plan", "--config", config, "--json"] + flags,
                         capture_output=True, text=True, check=True).stdout
    j = json.loads(out)
    return j["candidates"][j["chosen"]]["iteration_s"] * 1e3, j["even_expert_load_iteration_s"] * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", required=True, help="farskip_overlap.csv of the bench run")
    ap.add_argument("--runs", default="runs/bench_farskip", help="the bench's run directory (its --work)")
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--out", required=True, help="where the table goes (also printed)")
    a = ap.parse_args()

    lines, errors = [], {"probed": [], "even expert load": [], "uniform": []}
    for r in csv.DictReader(open(a.csv)):
        setting, run = r["setting"], r["run"]
        summary = json.load(open(os.path.join(a.runs, setting, run, "summary.json")))
        config = os.path.join(a.runs, setting, "job.yaml")
        uniform = os.path.join(a.runs, setting, "job_uniform_routing.yaml")
        with open(config) as f, open(uniform, "w") as g:
            g.write(f.read() + "data:\n  source: /nonexistent/xdmoe-routing-ab\n")
        flags = (["--farskip"] if "farskip" in run else []) + (["--no-overlap"] if "simple" in run else [
            "--pipeline-degree", str(summary["pipeline_degree"]),
            "--backward-pipeline-degree", str(summary["backward_pipeline_degree"])])
        measured = float(r["step_ms"])
        (probed, even), (flat, _) = plan_ms(a.xdmoe, config, flags), plan_ms(a.xdmoe, uniform, flags)
        ep, ee, eu = ((x / measured - 1) * 100 for x in (probed, even, flat))
        errors["probed"].append(ep)
        errors["even expert load"].append(ee)
        errors["uniform"].append(eu)
        lines.append("%-10s %-22s measured %6.1f  F %6.1f (%+5.1f%%)  even experts %6.1f (%+5.1f%%)  F=1 %6.1f (%+5.1f%%)"
                     % (setting, run, measured, probed, ep, even, ee, flat, eu))
        print(lines[-1], flush=True)
    for name, e in errors.items():
        lines.append("%s: %d of %d within 10%%, mean |error| %.1f%%, range %+.1f%% to %+.1f%%"
                     % (name, sum(abs(x) <= 10 for x in e), len(e), statistics.mean(abs(x) for x in e), min(e), max(e)))
        print(lines[-1])
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
