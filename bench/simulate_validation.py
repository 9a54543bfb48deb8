#!/usr/bin/env python3
"""The simulator against real runs (docs/simulation.md, "Validation").

For 2 DC x 2 and 4 DC x 2 workers, EP and every HybridEP domain candidate
runs for real (`xdmoe launch`, FarSkip overlapped, the README demo's model and
links), then `xdmoe simulate` replays the same job with the same domains and
pipeline degree, two ways:
  measured compute: the compute spans scaled so that a step computes what
      the run measured (--measured-compute-s, as the planner's "predicted
      with measured compute"), leaving the network and the schedule to the
      simulator; the planner's stream model with the same compute beside it;
  measured compute and routing: the same, with each link's token A2A hops
      as long as the run measured them (--a2a-imbalance LINK=moe_peak_raw /
      (moe_dispatch_raw + moe_combine_raw) from its summary): the router does
      not spread rows evenly, and a hop lasts as long as its larger side;
  measured compute, routing and hops: the same, with each hop of a
      collective paying a fixed overhead beyond its bytes and latency
      (--hop-overhead LEVEL=TIME: packing, copies and thread wake-ups with
      several workers per core). The default is what one traced EP step of
      the 2 x 2 job measured (bench/README.md, "Simulation"); with
      --hops-per-core it is scaled by the workers per core of each layout
      relative to that 2 x 2 run's;
  machine: the compute model calibrated on this machine (`xdmoe plan`'s
      probes) with every worker computing on this machine's cores, shared
      (--machine-cores), so SimGrid's CPU model slows concurrent spans.
Writes bench/results/simulate_validation.{csv,txt}. --reuse simulates the
runs of an earlier call again without launching them.

usage: python3 bench/simulate_validation.py [--xdmoe build/xdmoe] [--steps 12] [--layouts 2x2,4x2] [--reuse]
           [--hop-overhead dc=1.7ms,worker=2.8ms] [--hops-per-core]
"""
import argparse
import csv
import json
import os
import shutil
import subprocess
import sys

MODEL = """model:
  expert_intermediate_size: 128
  shared_intermediate_size: 128
train:
  steps: {steps}
  log_every: 100
  eval_every: 0
cluster:
  levels:
    - name: dc
      size: {dcs}
      link: {{bandwidth: 100mbit, latency: 10ms, shape: true}}
    - name: worker
      size: 2
      link: {{bandwidth: 1gbit, latency: 0.2ms, shape: true}}
  expert_parallel:
    memory_cap: unlimited
"""
FLOPS = 1e10  # any rate: the compute is scaled to the measured one


def candidates(dcs):
    out = []
    for a in range(1, dcs + 1):
        if dcs % a:
            continue
        for b in (1, 2):
            out.append((a, b))
    return out


def run_name(d):
    return "ep+farskip" if d == (1, 1) else f"hybrid+farskip+d{d[0]}x{d[1]}"


def simulate(xdmoe, config, d, r, extra):
    cmd = [xdmoe, "simulate", "--config", config, "--mode", "hybrid", "--domains", f"{d[0]},{d[1]}", "--farskip",
           "--pipeline-degree", str(r), "--steps", "3", "--json"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"simulate failed: {' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def imbalance_args(summary):
    """--a2a-imbalance per link class from a run's summary (1 where the run
    sent no token rows on it)."""
    b = summary["bytes_per_step"]
    out = []
    for link in ("dc", "worker"):
        sent = b.get(link + "/moe_dispatch_raw", 0) + b.get(link + "/moe_combine_raw", 0)
        if sent == 0:
            continue
        if b.get(link + "/moe_peak_raw", 0) <= 0:
            sys.exit(f"{summary['job']}: its summary has token rows on {link} but no moe_peak_raw bytes "
                     "(a run of an older build?)")
        out += ["--a2a-imbalance", "%s=%.4f" % (link, max(1.0, b[link + "/moe_peak_raw"] / sent))]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdmoe", default="build/xdmoe")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layouts", default="2x2,4x2")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reuse", action="store_true", help="simulate the runs of an earlier call again")
    p.add_argument("--hop-overhead", default="dc=1.7ms,worker=2.8ms",
                   help="LEVEL=TIME,...: per-hop overhead of the '+ hops' column (default: a traced 2x2 EP step)")
    p.add_argument("--hops-per-core", action="store_true",
                   help="scale the hop overhead by each layout's workers per core over the 2x2 run's (4 on this "
                        "machine's cores)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for layout in a.layouts.split(","):
        dcs = int(layout.split("x")[0])
        run_dir = os.path.join("runs", "bench_simulate", layout)
        config = os.path.join(run_dir, "job.yaml")
        cands = candidates(dcs)
        if not a.reuse:
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            with open(config, "w") as f:
                f.write(MODEL.format(steps=a.steps, dcs=dcs))
        cmd = [a.xdmoe, "launch", "--config", config, "--run-dir", run_dir, "--steps", str(a.steps), "--no-replan"]
        for d in cands:
            cmd += ["--mode", run_name(d)]
        if not a.reuse:
            print("$", " ".join(cmd), flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"launch failed ({out.returncode}):\n{out.stderr[-3000:]}")
        for d in cands:
            with open(os.path.join(run_dir, run_name(d), "summary.json")) as f:
                j = json.load(f)
            r = j["pipeline_degree"]
            s = simulate(a.xdmoe, config, d, r, ["--flops-per-s", str(FLOPS), "--measured-compute-s",
                                                  repr(j["mean_compute_s"])])
            imb = imbalance_args(j)
            sr = simulate(a.xdmoe, config, d, r, ["--flops-per-s", str(FLOPS), "--measured-compute-s",
                                                   repr(j["mean_compute_s"])] + imb)
            # Workers per core (2 x dcs over the cores) relative to 2 x 2's (4 over them).
            scale = dcs / 2 if a.hops_per_core else 1.0
            hops = []
            for item in a.hop_overhead.split(","):
                level, value = item.split("=")
                if not value.endswith("ms"):
                    sys.exit(f"--hop-overhead {item}: give milliseconds, e.g. {level}=2ms")
                hops += ["--hop-overhead", "%s=%.6gs" % (level, scale * float(value[:-2]) / 1e3)]
            sh = simulate(a.xdmoe, config, d, r, ["--flops-per-s", str(FLOPS), "--measured-compute-s",
                                                   repr(j["mean_compute_s"])] + imb + hops)
            m = simulate(a.xdmoe, config, d, r, ["--machine-cores", str(os.cpu_count())])
            measured, simulated, planner = j["mean_step_s"], s["simulated_step_s"], s["planner_step_s"]
            routed = sr["simulated_step_s"]
            hopped = sh["simulated_step_s"]
            machine = m["simulated_step_s"]
            rows.append({
                "layout": layout,
                "domains": f"{d[0]}x{d[1]}",
                "pipeline_degree": r,
                "measured_ms": round(measured * 1e3, 1),
                "simulated_ms": round(simulated * 1e3, 1),
                "simulated_err_pct": round(100 * (simulated / measured - 1), 1),
                "a2a_imbalance": " ".join(imb[1::2]) or "none",
                "routed_sim_ms": round(routed * 1e3, 1),
                "routed_sim_err_pct": round(100 * (routed / measured - 1), 1),
                "hop_overhead": " ".join(hops[1::2]),
                "hops_sim_ms": round(hopped * 1e3, 1),
                "hops_sim_err_pct": round(100 * (hopped / measured - 1), 1),
                "planner_ms": round(planner * 1e3, 1),
                "planner_err_pct": round(100 * (planner / measured - 1), 1),
                "machine_sim_ms": round(machine * 1e3, 1),
                "machine_sim_err_pct": round(100 * (machine / measured - 1), 1),
                "planner_startup_ms": round(j["predicted_step_s"] * 1e3, 1),
                "measured_compute_ms": round(j["mean_compute_s"] * 1e3, 1),
                "measured_step_over_bound": round(j["step_over_bound"], 3),
                "measured_overlap_pct": round(j["overlap_percent"], 1),
                "simulated_overlap_pct": round(s["steps"][-1]["overlap_percent"], 1),
                "simulated_step_over_bound": round(simulated / s["steps"][-1]["bound_s"], 3),
                "routed_sim_step_over_bound": round(routed / sr["steps"][-1]["bound_s"], 3),
                "hops_sim_step_over_bound": round(hopped / sh["steps"][-1]["bound_s"], 3),
            })
            print(rows[-1], flush=True)
    with open(os.path.join(a.out, "simulate_validation.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    lines = ["layout domains r | measured ms | simulated ms (err) | + routing ms (err) [imbalance] | "
             "+ hops ms (err) [overhead] | planner ms (err) | "
             "machine sim ms (err) | overlap meas/sim | step/bound meas/sim/+routing/+hops"]
    for layout in a.layouts.split(","):
        sub = [x for x in rows if x["layout"] == layout]
        for x in sub:
            lines.append(f"{x['layout']} {x['domains']} r={x['pipeline_degree']} | {x['measured_ms']} | "
                         f"{x['simulated_ms']} ({x['simulated_err_pct']:+}%) | "
                         f"{x['routed_sim_ms']} ({x['routed_sim_err_pct']:+}%) [{x['a2a_imbalance']}] | "
                         f"{x['hops_sim_ms']} ({x['hops_sim_err_pct']:+}%) [{x['hop_overhead']}] | "
                         f"{x['planner_ms']} ({x['planner_err_pct']:+}%) | "
                         f"{x['machine_sim_ms']} ({x['machine_sim_err_pct']:+}%) | "
                         f"{x['measured_overlap_pct']}/{x['simulated_overlap_pct']} | "
                         f"{x['measured_step_over_bound']}/{x['simulated_step_over_bound']}/"
                         f"{x['routed_sim_step_over_bound']}/{x['hops_sim_step_over_bound']}")
        best = {k: min(sub, key=lambda x: x[k])["domains"]
                for k in ("measured_ms", "simulated_ms", "routed_sim_ms", "hops_sim_ms", "planner_ms", "machine_sim_ms")}
        lines.append(f"{layout} best: measured {best['measured_ms']}, simulated {best['simulated_ms']}, "
                     f"+ routing {best['routed_sim_ms']}, + hops {best['hops_sim_ms']}, planner {best['planner_ms']}, "
                     f"machine sim {best['machine_sim_ms']}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "simulate_validation.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
