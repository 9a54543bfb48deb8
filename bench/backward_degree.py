#!/usr/bin/env python3
"""The pipeline degree per direction (FSMoE Sec. 4): the same FarSkip-overlapped
job with the forward's all-to-alls in r chunks and the backward's in r / s
exchanges of s chunks each, against r both ways and the planner's pair.

Two settings, each a real `xdmoe launch` (a coordinator and worker processes
over loopback) of the README demo's job, 2 DCs x 2 workers, the inter-DC link
at 100 Mbit/s and 10 ms:
  ep      EP (domains 1 x 1): tokens cross both levels, so the exchange runs
          on its comm threads and every exchange pays each level's latency in
          turn
  hybrid  HybridEP, domains 2 x 1: the experts are gathered across the DCs and
          the tokens cross only the worker level, on the compute thread
          ("direct" exchanges)
The runs of a setting go in one launch, and the launch is repeated with the
runs in reverse order, so each pair of figures shares the machine's state.
Figures are means over the steps after two warm-up steps: step time, step /
bound, overlap % per direction (the most-waiting worker), the planner's
prediction at start-up.

usage: python3 bench/backward_degree.py [--xdmoe build/xdmoe] [--steps 30]
           [--settings ep,hybrid] [--degrees 4,4/2,4/1,0] [--repeat 2] [--out bench/results]
Writes <out>/backward_degree.csv and .txt.
"""
import argparse
import csv
import os
import shutil

from farskip_overlap import launch  # runs `xdmoe launch` and reads each run's summary

MODES = {"ep": "ep+farskip", "hybrid": "hybrid+farskip+d2x1"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdmoe", default="build/xdmoe")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settings", default="ep,hybrid")
    p.add_argument("--degrees", default="4,4/2,4/1,0",
                   help="r or r/backward r per run; 0: the planner's pair")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name in a.settings.split(","):
        runs = [f"{MODES[name]}+r{d}" for d in a.degrees.split(",")]
        for rep in range(a.repeat):
            order = runs if rep % 2 == 0 else list(reversed(runs))
            run_dir = os.path.join("runs", "bench_backward_degree", f"{name}_{rep}")
            shutil.rmtree(run_dir, ignore_errors=True)
            summaries = launch(a.xdmoe, None, order, a.steps, run_dir, None)
            for r in runs:
                j = summaries[r]
                rows.append({
                    "setting": name,
                    "repeat": rep,
                    "run": r,
                    "r": j["pipeline_degree"],
                    "backward_r": j.get("backward_pipeline_degree", j["pipeline_degree"]),
                    "step_ms": round(j["mean_step_s"] * 1e3, 1),
                    "bound_ms": round(j["bound_s"] * 1e3, 1),
                    "step_over_bound": round(j["step_over_bound"], 3),
                    "fwd_overlap_pct": round(j["fwd_overlap_percent"], 1),
                    "bwd_overlap_pct": round(j["bwd_overlap_percent"], 1),
                    "bwd_exposed_ms": round(j.get("mean_bwd_exposed_s", 0) * 1e3, 1),
                    "predicted_ms": round(j.get("startup_predicted_step_s", j["predicted_step_s"]) * 1e3, 1),
                    "final_loss": round(j["final_loss"], 4),
                })
    keys = list(rows[0].keys())
    with open(os.path.join(a.out, "backward_degree.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = [f"{'setting':7} {'rep':>3} {'r':>5} {'step ms':>8} {'vs r/r':>7} {'bound':>7} {'step/bnd':>8} "
             f"{'fwd ovl%':>8} {'bwd ovl%':>8} {'bwd exp':>8} {'pred ms':>8} {'loss':>7}"]
    for row in rows:
        same = [x for x in rows if x["setting"] == row["setting"] and x["repeat"] == row["repeat"]][0]
        lines.append(f"{row['setting']:7} {row['repeat']:>3} {'%d/%d' % (row['r'], row['backward_r']):>5} "
                     f"{row['step_ms']:>8} {same['step_ms'] / row['step_ms']:>6.3f}x {row['bound_ms']:>7} "
                     f"{row['step_over_bound']:>8.2f} {row['fwd_overlap_pct']:>8} {row['bwd_overlap_pct']:>8} "
                     f"{row['bwd_exposed_ms']:>8} {row['predicted_ms']:>8} {row['final_loss']:>7}")
    lines.append("vs r/r: the first run of the setting's launch (the first --degrees entry) over this one; "
                 "bwd exp: the most-waiting worker's exposed backward communication per step")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "backward_degree.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
