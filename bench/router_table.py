#!/usr/bin/env python3
"""Routers side by side (FSMoE Table 6, on this system): for every routing
function, the tokens/s of a training step in one process and on 2 DCs x 2
workers, and the loss after a fixed budget of steps on the default corpus.

The job is the README demo's (examples/2dc.yaml with 16 sequences of 64
tokens per worker and experts of intermediate size 128: 4 layers, d = 128, 8
experts, top-2, one shared expert; inter-DC link 100 Mbit/s and 10 ms, shaped
in the process) with only `model.gating` changed (SoftMoE: 1 slot per expert, so every token reaches all
8 experts; X-MoE: routing dimension E/2 = 4).
  one process   `xdmoe train` on the job's global batch (4 x 16 sequences of 64
                tokens per step) for --steps steps: tokens/s (median of the
                logged steps after the first), the final training loss and
                cross entropy, and the held-out cross entropy at the end
                (no routing noise at evaluation).
  2 x 2         `xdmoe launch` for --dist-steps steps, once per run of
                --dist-modes (default: `auto`, the planner's HybridEP domains
                on the same model, which computes what one process does,
                tests/actors_router_distributed_test.cc; and `auto+farskip`,
                the same with FarSkip connectivity and communication
                overlapped): tokens/s (the summary's mean), step / bound and
                overlap % per direction.

usage: python3 bench/router_table.py [--xdmoe build/xdmoe] [--steps 120]
           [--dist-steps 30] [--dist-modes auto,auto+farskip]
           [--routers softmax_topk,...] [--out bench/results]
Writes <out>/router_table.csv and .txt.
"""
import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess
import sys

from farskip_overlap import launch  # runs `xdmoe launch` and reads each run's summary

ROUTERS = ["softmax_topk", "sigmoid_topk", "expert_choice", "gshard_noisy_topk", "xmoe", "soft_moe"]


def job_yaml(router, steps):
    with open("examples/2dc.yaml") as f:
        y = f.read()
    y = y.replace("  gating: softmax_topk\n", f"  gating: {router}\n", 1)
    # The README demo's sizes (cluster/job_config.cc, default_job_config).
    y = y.replace("  expert_intermediate_size: 256\n", "  expert_intermediate_size: 128\n", 1)
    y = y.replace("  shared_intermediate_size: 256\n", "  shared_intermediate_size: 128\n", 1)
    y = re.sub(r"\n  batch_size: \d+ ", "\n  batch_size: 16 ", y, count=1)
    assert "batch_size: 16 " in y and "expert_intermediate_size: 128" in y
    y = re.sub(r"\n  steps: \d+\n", f"\n  steps: {steps}\n", y, count=1)
    y = re.sub(r"\n  eval_every: \d+\n", f"\n  eval_every: {steps}\n", y, count=1)
    y = re.sub(r"\n  log_every: \d+\n", "\n  log_every: 10\n", y, count=1)
    y = re.sub(r"\n  checkpoint_dir: .*\n", "\n", y, count=1)
    assert f"gating: {router}" in y
    return y


def one_process(xdmoe, config):
    cmd = [xdmoe, "train", "--config", config]
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if out.returncode != 0:
        sys.exit(f"train failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    text = out.stdout + out.stderr
    rates = [float(m) for m in re.findall(r"\| (\d+) tok/s", text)]
    done = re.search(r"final loss ([\d.]+) \(ce ([\d.]+)\)", text)
    held = re.findall(r"held-out ce ([\d.]+)", text)
    if not rates or not done or not held:
        sys.exit("could not read the train output:\n" + text[-2000:])
    return {"tok_s": statistics.median(rates[1:] or rates), "loss": float(done.group(1)),
            "ce": float(done.group(2)), "held_out_ce": float(held[-1])}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdmoe", default="build/xdmoe")
    p.add_argument("--steps", type=int, default=120, help="one-process budget (steps)")
    p.add_argument("--dist-steps", type=int, default=30, help="steps of each 2 x 2 run")
    p.add_argument("--dist-modes", default="auto,auto+farskip", help="xdmoe launch runs for the 2 x 2 columns")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for router in a.routers.split(","):
        run_dir = os.path.join("runs", "bench_routers", router)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        config = os.path.join(run_dir, "job.yaml")
        with open(config, "w") as f:
            f.write(job_yaml(router, a.steps))
        single = one_process(a.xdmoe, config)
        modes = a.dist_modes.split(",")
        dist = launch(a.xdmoe, config, modes, a.dist_steps, os.path.join(run_dir, "launch"), None)
        for m in modes:
            j = dist[m]
            rows.append({
                "router": router,
                "one_process_tok_s": round(single["tok_s"]),
                "dist_mode": m,
                "dist_tok_s": round(j["mean_tokens_per_s"]),
                "dist_step_ms": round(j["mean_step_s"] * 1e3, 1),
                "step_over_bound": round(j["step_over_bound"], 3),
                "fwd_overlap_pct": round(j["fwd_overlap_percent"], 1),
                "bwd_overlap_pct": round(j["bwd_overlap_percent"], 1),
                "domains": "x".join(str(s) for s in j.get("domain_sizes", [])),
                "pipeline_degree": j.get("pipeline_degree", 1),
                "loss": single["loss"],
                "ce": single["ce"],
                "held_out_ce": single["held_out_ce"],
            })
            print(rows[-1], flush=True)
    with open(os.path.join(a.out, "router_table.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    lines = [f"{'router':18} {'1-proc tok/s':>12} {'2x2 run':>13} {'2x2 tok/s':>10} {'2x2 ms':>8} {'step/bnd':>8} "
             f"{'fwd/bwd ovl%':>12} {'domains':>7} {'r':>2} {'loss':>7} {'ce':>7} {'held-out ce':>11}"]
    for r in rows:
        lines.append(f"{r['router']:18} {r['one_process_tok_s']:>12} {r['dist_mode']:>13} {r['dist_tok_s']:>10} "
                     f"{r['dist_step_ms']:>8} {r['step_over_bound']:>8.2f} {r['fwd_overlap_pct']:>5.0f} / "
                     f"{r['bwd_overlap_pct']:<4.0f} {r['domains']:>7} {r['pipeline_degree']:>2} {r['loss']:>7.4f} "
                     f"{r['ce']:>7.4f} {r['held_out_ce']:>11.4f}")
    lines.append(f"loss, ce: training loss and cross entropy at step {a.steps} in one process; held-out ce: "
                 "evaluation at the end (nats)")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "router_table.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
