#!/usr/bin/env python3
"""HybridEP Table V, reproduced on this machine: EP vs HybridEP step time as the
per-worker token data D grows, with the expert size fixed and the inter-DC link
shaped so that communication dominates. Every expert-domain candidate is run, so
the `auto` plan's pick can be checked against the measured best.

usage: python3 bench/hybrid_ep_table5.py [--xdmoe build/xdmoe] [--steps 8]
           [--rounds 2] [--layouts 2x2,4x2] [--batches 1,2,4,8,16] [--out bench/results]
The candidates of one point run interleaved, round after round (each round in a
rotated order), so a burst of load from other jobs on the shared machine hits
one run of a candidate, not all of its runs; a candidate's time is the median
of its steps after warm-up, pooled over the rounds.
Writes <out>/table5.csv, <out>/table5.txt and <out>/table5.png (gnuplot).
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import time

MODEL = """model:
  hidden_size: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 64
  num_experts: 8
  top_k: 2
  expert_intermediate_size: 64
  num_shared_experts: 0
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
"""

CLUSTER = """cluster:
  levels:
    - name: dc
      size: {dcs}
      link: {{bandwidth: {dc_bw}, latency: {dc_lat}, shape: true}}
    - name: worker
      size: {per_dc}
      link: {{bandwidth: 1gbit, latency: 0.1ms, shape: true}}
  expert_parallel:
    mode: hybrid
    domain_sizes: [{s0}, {s1}]
    memory_cap: unlimited
"""


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def run_case(args, dcs, per_dc, batch, domains, workdir):
    os.makedirs(workdir, exist_ok=True)
    cfg = os.path.join(workdir, "job.yaml")
    with open(cfg, "w") as f:
        f.write(MODEL.format(steps=args.steps, batch=batch))
        f.write(CLUSTER.format(dcs=dcs, per_dc=per_dc, s0=domains[0], s1=domains[1],
                               dc_bw=args.dc_bandwidth, dc_lat=args.dc_latency))
    cmd = [args.xdmoe, "launch", "--config", cfg, "--mode", "hybrid", "--run-dir", workdir,
           "--cli-bind", "tcp://127.0.0.1:*"]
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(workdir, "launch.log"), "w") as f:
        f.write(p.stdout)
    summary_path = os.path.join(workdir, "hybrid", "summary.json")
    if p.returncode != 0 or not os.path.exists(summary_path):
        sys.exit(f"run failed ({' '.join(cmd)}); see {workdir}/launch.log")
    with open(summary_path) as f:
        s = json.load(f)
    s["steady_step_times_s"] = s["step_times_s"][2:] or s["step_times_s"]  # after two warm-up steps
    s["wall_s"] = time.time() - t0
    return s, cfg


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def load_average():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def planned_choice(args, cfg):
    out = subprocess.run([args.xdmoe, "plan", "--config", cfg, "--json"], stdout=subprocess.PIPE, text=True, check=True)
    plan = json.loads(out.stdout)
    # The auto pick over the same candidates (the config's mode is hybrid).
    best = min((c for c in plan["candidates"] if c.get("feasible", True)), key=lambda c: c["iteration_s"])
    return best["domain_sizes"], {tuple(c["domain_sizes"]): c["iteration_s"] for c in plan["candidates"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="runs of every candidate, interleaved")
    ap.add_argument("--layouts", default="2x2,4x2")
    ap.add_argument("--batches", default="1,2,4,8,16", help="sequences of 64 tokens per worker")
    ap.add_argument("--dc-bandwidth", default="50mbit")
    ap.add_argument("--dc-latency", default="10ms")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--work", default="runs/table5")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for layout in args.layouts.split(","):
        dcs, per_dc = (int(x) for x in layout.split("x"))
        for batch in (int(b) for b in args.batches.split(",")):
            cases = list(itertools.product(divisors(dcs), divisors(per_dc)))
            runs = {d: [] for d in cases}
            cfg = None
            for rnd in range(args.rounds):
                for i in range(len(cases)):
                    domains = cases[(i + rnd) % len(cases)]
                    work = os.path.join(args.work, f"{layout}_b{batch}_d{domains[0]}x{domains[1]}_r{rnd}")
                    load = load_average()
                    s, cfg = run_case(args, dcs, per_dc, batch, domains, work)
                    runs[domains].append(s)
                    print(f"{layout} batch {batch:3d} domains {domains} round {rnd + 1}/{args.rounds}: "
                          f"median step {median(s['steady_step_times_s'])*1e3:8.1f} ms "
                          f"(compute {s['mean_compute_s']*1e3:.1f}, exposed comm {s['mean_exposed_comm_s']*1e3:.1f}; "
                          f"predicted {s['predicted_step_s']*1e3:.1f}; load before {load:.2f})", flush=True)
            measured = {}
            for d, rs in runs.items():
                measured[d] = {
                    "median_step_s": median([t for r in rs for t in r["steady_step_times_s"]]),
                    "round_medians_s": [median(r["steady_step_times_s"]) for r in rs],
                    "mean_step_s": sum(r["mean_step_s"] for r in rs) / len(rs),
                    "mean_compute_s": sum(r["mean_compute_s"] for r in rs) / len(rs),
                    "mean_exposed_comm_s": sum(r["mean_exposed_comm_s"] for r in rs) / len(rs),
                    "final_loss": rs[-1]["final_loss"],
                }
            auto, predicted = planned_choice(args, cfg)
            auto = tuple(auto)
            best = min(measured, key=lambda d: measured[d]["median_step_s"])
            for d, s in measured.items():
                rows.append({
                    "layout": layout, "tokens_per_worker": batch * 64,
                    # D: bytes of one Dispatch per worker and MoE layer (top-2 copies of d=64 floats)
                    "D_bytes": batch * 64 * 2 * 64 * 4,
                    "domains": f"{d[0]}x{d[1]}", "is_ep": d == (1, 1), "is_auto": d == auto, "is_best": d == best,
                    "median_step_s": s["median_step_s"], "mean_step_s": s["mean_step_s"],
                    "round_medians_s": " ".join(f"{t:.4f}" for t in s["round_medians_s"]),
                    "compute_s": s["mean_compute_s"], "exposed_comm_s": s["mean_exposed_comm_s"],
                    "predicted_step_s": predicted.get(d, float("nan")), "final_loss": s["final_loss"],
                })
    with open(os.path.join(args.out, "table5.csv"), "w") as f:
        keys = list(rows[0].keys())
        f.write(",".join(keys) + "\n")
        for r in rows:
            f.write(",".join(str(r[k]) for k in keys) + "\n")
    # The table: per layout and D, EP vs the auto pick, and the pick vs the best.
    lines = ["layout  tokens/worker  D (KB)   EP (ms)  auto domains  auto (ms)  speedup  best domains  best (ms)  auto/best"]
    plot = {}
    for layout in args.layouts.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            sel = [r for r in rows if r["layout"] == layout and r["tokens_per_worker"] == batch * 64]
            ep = next(r for r in sel if r["is_ep"])
            auto = next(r for r in sel if r["is_auto"])
            best = next(r for r in sel if r["is_best"])
            lines.append(f"{layout:6s}  {batch*64:13d}  {ep['D_bytes']/1024:6.0f}  {ep['median_step_s']*1e3:8.1f}  "
                         f"{auto['domains']:>12s}  {auto['median_step_s']*1e3:9.1f}  {ep['median_step_s']/auto['median_step_s']:6.2f}x  "
                         f"{best['domains']:>12s}  {best['median_step_s']*1e3:9.1f}  {auto['median_step_s']/best['median_step_s']:8.3f}")
            plot.setdefault(layout, []).append((ep["D_bytes"] / 1024, ep["median_step_s"] * 1e3, auto["median_step_s"] * 1e3))
    text = "\n".join(lines)
    print("\n" + text)
    with open(os.path.join(args.out, "table5.txt"), "w") as f:
        f.write(text + "\n")
    dat = os.path.join(args.out, "table5.dat")
    with open(dat, "w") as f:
        for layout, pts in plot.items():
            f.write(f"# {layout}\n")
            for p in pts:
                f.write(f"{p[0]} {p[1]} {p[2]}\n")
            f.write("\n\n")
    png = os.path.join(args.out, "table5.png")
    script = f"""set terminal pngcairo size 900,520
set output '{png}'
set title 'EP vs HybridEP (auto plan): step time vs token data per worker, inter-DC {args.dc_bandwidth}, {args.dc_latency}'
set xlabel 'D: Dispatch bytes per worker and MoE layer (KB)'
set ylabel 'median step time (ms)'
set logscale x 2
set key left top
set grid
"""
    plots = []
    for i, layout in enumerate(plot):
        plots.append(f"'{dat}' index {i} using 1:2 with linespoints title 'EP {layout}'")
        plots.append(f"'{dat}' index {i} using 1:3 with linespoints title 'HybridEP {layout}'")
    script += "plot " + ", ".join(plots) + "\n"
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"\nwrote {args.out}/table5.csv, table5.txt, table5.png")


if __name__ == "__main__":
    main()
