#!/usr/bin/env python3
"""HybridEP Fig. 17 on our system: HybridEP over EP from 10 to 1000 datacenters,
simulated with `xdmoe simulate` (SimGrid) beside the planner's stream model.

  (a) fixed expert-domain size: domains [2, 8], 16 workers in 2 DCs;
  (b) fixed proportion p: domains [DCs / 10, 8], a tenth of the DCs per domain,
      so p (the share of tokens that still cross by A2A) stays about 0.9.

8 workers per DC, 1 routed expert per worker, the README demo's model with
small experts (intermediate size 32, 49 KB) and 4096 tokens per worker and
step, FarSkip overlapped, r = 1. Each DC has one uplink (each way) of 1, 10
or 100 Gbit/s that its 8 workers share, 10 ms latency; intra-DC 100 Gbit/s
and 10 us; compute from a fixed GEMM rate (--flops). The planner has no
uplink (it sees each worker's egress at the uplink's rate), so the EP step
it predicts beside the simulated one shows what the shared uplink costs.
Above 64 DCs the
simulator simulates 16 of them and leaves the rest to symmetry (exact for
these symmetric jobs; docs/simulation.md). The speed rows time one step of
1000 DCs x 8 workers, and the whole platform (every DC simulated) at 100 and
300 DCs.

Writes bench/results/fig17_simulation.{csv,txt,png}.
usage: python3 bench/fig17_simulation.py [--xdmoe build/xdmoe] [--flops 5e10]
"""
import argparse
import csv
import json
import os
import subprocess
import sys

JOB = """model:
  expert_intermediate_size: 32
  shared_intermediate_size: 128
train:
  batch_size: 64
  seq_len: 64
"""
DCS = [10, 20, 50, 100, 200, 500, 1000]
BANDWIDTHS = ["1gbit", "10gbit", "100gbit"]


def simulate(a, config, extra):
    cmd = [a.xdmoe, "simulate", "--config", config, "--json", "--flops-per-s", str(a.flops), "--farskip",
           "--pipeline-degree", "1", "--steps", "2", "--workers-per-dc", "8", "--experts-per-worker", "1",
           "--latency", "dc=10ms", "--latency", "worker=10us", "--bandwidth", "worker=100gbit"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"simulate failed: {' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdmoe", default="build/xdmoe")
    p.add_argument("--flops", type=float, default=5e10)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs("runs/bench_fig17", exist_ok=True)
    config = "runs/bench_fig17/job.yaml"
    with open(config, "w") as f:
        f.write(JOB)
    rows = []
    for bw in BANDWIDTHS:
        for dcs in DCS:
            base = ["--dcs", str(dcs), "--bandwidth", f"dc={bw}", "--uplink", bw]
            ep = simulate(a, config, base + ["--mode", "ep"])
            for case, s0 in (("a: fixed domain size", 2), ("b: fixed p", dcs // 10)):
                hy = simulate(a, config, base + ["--mode", "hybrid", "--domains", f"{s0},8"])
                rows.append({
                    "bandwidth": bw, "dcs": dcs, "case": case, "domains": f"{s0}x8",
                    "ep_sim_ms": round(ep["simulated_step_s"] * 1e3, 2),
                    "hybrid_sim_ms": round(hy["simulated_step_s"] * 1e3, 2),
                    "speedup_sim": round(ep["simulated_step_s"] / hy["simulated_step_s"], 3),
                    "ep_planner_ms": round(ep["planner_step_s"] * 1e3, 2),
                    "hybrid_planner_ms": round(hy["planner_step_s"] * 1e3, 2),
                    "speedup_planner": round(ep["planner_step_s"] / hy["planner_step_s"], 3),
                    "ep_step_over_bound": round(ep["simulated_step_s"] / ep["steps"][-1]["bound_s"], 3),
                    "hybrid_step_over_bound": round(hy["simulated_step_s"] / hy["steps"][-1]["bound_s"], 3),
                    "hybrid_overlap_pct": round(hy["steps"][-1]["overlap_percent"], 1),
                    "simulated_dcs": hy["simulated_dcs"],
                    "sim_wall_s": round(ep["wall_s"] + hy["wall_s"], 3),
                })
                print(rows[-1], flush=True)
    with open(os.path.join(a.out, "fig17_simulation.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)

    # Speed: one step of 1000 DCs x 8 workers; the whole platform at 100 and 300 DCs.
    speed = []
    for dcs, sim in ((1000, None), (100, 100), (300, 300)):
        extra = ["--dcs", str(dcs), "--bandwidth", "dc=10gbit", "--uplink", "10gbit", "--mode", "ep"]
        if sim:
            extra += ["--simulated-dcs", str(sim)]
        cmd = ["/usr/bin/time", "-f", "%e %M"]
        r = subprocess.run(cmd + [a.xdmoe, "simulate", "--config", config, "--json", "--flops-per-s", str(a.flops),
                                  "--farskip", "--pipeline-degree", "1", "--steps", "1", "--workers-per-dc", "8",
                                  "--experts-per-worker", "1"] + extra, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"simulate failed:\n{r.stderr}")
        wall, kb = r.stderr.strip().splitlines()[-1].split()
        j = json.loads(r.stdout)
        speed.append(f"{dcs} DCs x 8 workers, {j['simulated_dcs']} simulated ({j['flows']} flows, "
                     f"{j['flow_count']} of them, {j['actors']} actors): {float(wall):.2f} s, "
                     f"{int(kb) / 1024:.0f} MB peak")
        print(speed[-1], flush=True)

    lines = []
    for case in ("a: fixed domain size", "b: fixed p"):
        lines.append(f"({case}) speedup of HybridEP over EP, simulated (planner)")
        lines.append("DCs      " + "  ".join(f"{bw:>16}" for bw in BANDWIDTHS))
        for dcs in DCS:
            cells = []
            for bw in BANDWIDTHS:
                x = next(r for r in rows if r["bandwidth"] == bw and r["dcs"] == dcs and r["case"] == case)
                cells.append(f"{x['speedup_sim']:6.2f} ({x['speedup_planner']:5.2f})")
            lines.append(f"{dcs:<8} " + "  ".join(f"{c:>16}" for c in cells))
        lines.append("")
    lines.append("EP step, simulated / planner (the shared uplink the planner does not see)")
    lines.append("DCs      " + "  ".join(f"{bw:>22}" for bw in BANDWIDTHS))
    for dcs in DCS:
        cells = []
        for bw in BANDWIDTHS:
            x = next(r for r in rows if r["bandwidth"] == bw and r["dcs"] == dcs)
            cells.append(f"{x['ep_sim_ms']:8.1f} / {x['ep_planner_ms']:7.1f} ms")
        lines.append(f"{dcs:<8} " + "  ".join(f"{c:>22}" for c in cells))
    lines.append("")
    lines += ["speed:"] + speed
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "fig17_simulation.txt"), "w") as f:
        f.write(text)
    print(text)

    # The plot: one panel per case, a line per bandwidth, simulated solid and planner dashed.
    dat = "runs/bench_fig17/fig17.dat"
    with open(dat, "w") as f:
        for case in ("a: fixed domain size", "b: fixed p"):
            for bw in BANDWIDTHS:
                f.write(f"# {case} {bw}\n")
                for r in rows:
                    if r["case"] == case and r["bandwidth"] == bw:
                        f.write(f"{r['dcs']} {r['speedup_sim']} {r['speedup_planner']}\n")
                f.write("\n\n")
    png = os.path.join(a.out, "fig17_simulation.png")
    gp = f"""set terminal pngcairo size 1200,520 font ',10'
set label 1 'per-DC uplink shared by 8 workers; solid: simulated (SimGrid), dashed: planner' at screen 0.5,0.02 center
set bmargin 5
set output '{png}'
set multiplot layout 1,2
set logscale x
set xlabel 'datacenters (8 workers each)'
set ylabel 'HybridEP speedup over EP'
set key top right
set grid
"""
    for panel, title in enumerate(("(a) fixed domain size [2, 8]", "(b) fixed p (domains [DCs/10, 8])")):
        gp += f"set title '{title}'\nplot "
        parts = []
        for i, bw in enumerate(BANDWIDTHS):
            idx = panel * len(BANDWIDTHS) + i
            parts.append(f"'{dat}' index {idx} using 1:2 with linespoints lw 2 lc {i + 1} title '{bw} simulated'")
            parts.append(f"'{dat}' index {idx} using 1:3 with lines dt 2 lc {i + 1} title '{bw} planner'")
        gp += ", ".join(parts) + "\n"
    gp += "unset multiplot\n"
    r = subprocess.run(["gnuplot"], input=gp, text=True, capture_output=True)
    if r.returncode != 0:
        print(f"gnuplot failed, no PNG: {r.stderr}", file=sys.stderr)
    else:
        print("wrote", png)


if __name__ == "__main__":
    main()
