#!/usr/bin/env python3
"""End to end with expert compression (HybridEP Table VI, Fig. 13), on this
machine: EP, HybridEP with raw experts, and HybridEP + SR, on 2 DC x 2 and
4 DC x 2 workers with the inter-DC link shaped, over expert sizes spanning 16x
at a fixed token volume. HybridEP runs the domain sizes the planner picks for
its codecs (mode auto); EP runs domain sizes all 1.

HybridEP + SR sends, on the inter-DC link only:
  expert_gather: sr:ef:topk:<density>+zstd:1   (the SR codec with error feedback;
                 sr:ef:topk_sign:<density>+zstd:1 with --sign;
                 any SR spec with --expert-gather, e.g. sr:ef:block_sign:0.5+zstd:1)
  expert_grad:   ef:topk:<grad density>+zstd:1 (replica gradients, error feedback;
                 any spec with --expert-grad, e.g. ef:int8_row+zstd:1)
with the SR base re-synchronised every --base-every steps. With --farskip all
three run FarSkip connectivity, overlapped, instead of regular connectivity
(the same model for each; its transfers hide behind compute where they can).

usage: python3 bench/sr_end_to_end.py [--xdmoe build/xdmoe] [--steps 8]
           [--layouts 2x2,4x2] [--ff 32,64,128,256,512] [--batch 8]
           [--table5-point] [--separate-encode] [--sign] [--density D]
           [--expert-gather SPEC] [--grad-density D] [--expert-grad SPEC] [--base-every N] [--base-codec sign]
           [--dense-grad bf16] [--dc-bandwidth 50mbit] [--dc-latency 10ms]
           [--farskip] [--rounds N] [--out bench/results]
--table5-point adds the largest point of bench/hybrid_ep_table5.py (4x2,
2048 tokens per worker, ff 64) to compare HybridEP + SR with EP there.
Writes <out>/sr_end_to_end.csv, .txt and .png (gnuplot). Step times are the
median of the steps after two warm-up steps; each row also gives the bound
(max(compute, busiest link's transmit time)), step / bound and overlap.
With --rounds N the three variants run N times, alternating round by round;
the table gives each variant's median over the rounds and the SR/EP ratio of
every round (the CSV keeps every run, with its round).
"""
import argparse
import json
import os
import subprocess
import sys

MODEL = """model:
  hidden_size: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 64
  num_experts: 8
  top_k: 2
  expert_intermediate_size: {ff}
  num_shared_experts: 0
  aux_loss_coef: 0.01
  expert_init_spread: 0.2
train:
  steps: {steps}
  batch_size: {batch}
  seq_len: 64
  warmup_steps: 2
  log_every: 100
  eval_every: 0
data:
  builtin_bytes: 262144
cluster:
  levels:
    - name: dc
      size: {dcs}
      link: {{bandwidth: {dc_bw}, latency: {dc_lat}, shape: true, codecs: {{{codecs}}}}}
    - name: worker
      size: {per_dc}
      link: {{bandwidth: 1gbit, latency: 0.1ms, shape: true}}
  expert_parallel:
    mode: {mode}
    domain_sizes: [1, 1]
    memory_cap: unlimited
    base_sync_every: {base_every}
    base_codec: {base_codec}
    fused_encode: {fused}
farskip: {{enabled: {farskip}, overlapped: true}}
"""


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def over_rounds(rows):
    """One variant at one point over the rounds: its median step, and that step over the median bound."""
    out = dict(rows[0])
    out["median_step_s"] = median([r["median_step_s"] for r in rows])
    bound = median([r["bound_s"] for r in rows])
    out["step_over_bound"] = out["median_step_s"] / bound if bound > 0 else 0.0
    return out


def run(args, name, layout, ff, batch, mode, codecs, round_no):
    dcs, per_dc = (int(x) for x in layout.split("x"))
    suffix = f"_round{round_no}" if args.rounds > 1 else ""
    work = os.path.join(args.work, f"{layout}_ff{ff}_b{batch}_{name}{suffix}")
    os.makedirs(work, exist_ok=True)
    cfg = os.path.join(work, "job.yaml")
    with open(cfg, "w") as f:
        f.write(MODEL.format(ff=ff, steps=args.steps, batch=batch, dcs=dcs, per_dc=per_dc, dc_bw=args.dc_bandwidth,
                             dc_lat=args.dc_latency, codecs=codecs, mode=mode, base_every=args.base_every,
                             base_codec=args.base_codec, farskip="true" if args.farskip else "false",
                             fused="false" if args.separate_encode else "true"))
    p = subprocess.run([args.xdmoe, "launch", "--config", cfg, "--run-dir", work, "--cli-bind", "tcp://127.0.0.1:*"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(work, "launch.log"), "w") as f:
        f.write(p.stdout)
    summary = os.path.join(work, mode, "summary.json")
    if p.returncode != 0 or not os.path.exists(summary):
        sys.exit(f"{name} {layout} ff {ff} failed; see {work}/launch.log")
    s = json.load(open(summary))
    steps = s["step_times_s"][2:] or s["step_times_s"]
    b = s["bytes_per_step"]
    row = {
        "round": round_no, "layout": layout, "ff": ff, "expert_KB": 3 * 64 * ff * 4 / 1e3,
        "tokens_per_worker": batch * 64,
        "variant": name, "domains": "x".join(str(d) for d in s.get("domain_sizes", [])),
        "median_step_s": median(steps), "bound_s": s["bound_s"],
        "step_over_bound": median(steps) / s["bound_s"] if s["bound_s"] > 0 else 0.0,
        "overlap_percent": s["overlap_percent"], "compute_s": s["mean_compute_s"],
        "dc_MB_per_step": b.get("dc/total", 0.0) / 1e6,
        "dc_expert_MB": (b.get("dc/expert_gather", 0.0) + b.get("dc/expert_grad", 0.0)) / 1e6,
        "final_loss": s["final_loss"],
    }
    prefix = f"round {round_no} " if args.rounds > 1 else ""
    print(f"{prefix}{layout} ff {ff:4d} {name:12s} domains {row['domains']:5s} step {row['median_step_s']*1e3:8.1f} ms "
          f"(bound {row['bound_s']*1e3:.1f}, step/bound {row['step_over_bound']:.2f}, overlap {row['overlap_percent']:.0f}%) "
          f"dc {row['dc_MB_per_step']:.2f} MB/step, loss {row['final_loss']:.4f}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layouts", default="2x2,4x2")
    ap.add_argument("--ff", default="32,64,128,256,512", help="expert_intermediate_size values (hidden 64)")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per worker")
    ap.add_argument("--density", default=None,
                    help="top-k density of the SR codec (default 0.04, or 0.1 with --sign: about the same bytes)")
    ap.add_argument("--sign", action="store_true",
                    help="the SR codec sends 1-bit values (topk_sign) instead of bf16 ones (topk)")
    ap.add_argument("--expert-gather", default=None,
                    help="the whole expert_gather spec of HybridEP + SR (overrides --sign and --density)")
    ap.add_argument("--grad-density", default="0.1", help="top-k density of the replica-gradient codec")
    ap.add_argument("--expert-grad", default=None,
                    help="the whole expert_grad spec of HybridEP + SR (overrides --grad-density), "
                         "e.g. ef:int8_row+zstd:1")
    ap.add_argument("--base-every", type=int, default=10)
    ap.add_argument("--base-codec", choices=["bf16", "sign"], default="bf16",
                    help="expert_parallel.base_codec: how the SR base's sums cross the DC link")
    ap.add_argument("--dc-bandwidth", default="50mbit")
    ap.add_argument("--dc-latency", default="10ms")
    ap.add_argument("--table5-point", action="store_true")
    ap.add_argument("--separate-encode", action="store_true",
                    help="expert_parallel.fused_encode: false (pack the AG rows in a separate pass)")
    ap.add_argument("--dense-grad", choices=["raw", "bf16"], default="raw",
                    help="HybridEP + SR also sends the dense-gradient all-reduce in bf16 across the DCs "
                         "(MegaScale-MoE Sec. 5; codecs.dense_grad)")
    ap.add_argument("--farskip", action="store_true",
                    help="every variant runs FarSkip connectivity, overlapped (farskip: {enabled: true}): "
                         "the same model for all three, communication hidden where it can be")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the three variants this many times, alternating them round by round, and report "
                         "each variant's median over the rounds and the SR/EP ratio of every round: on a shared "
                         "machine whose speed drifts, one round's ratio can follow the drift")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--work", default="runs/sr_end_to_end")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    density = a.density or ("0.1" if a.sign else "0.04")
    values = "topk_sign" if a.sign else "topk"
    gather = a.expert_gather or f"sr:ef:{values}:{density}+zstd:1"
    grad = a.expert_grad or f"ef:topk:{a.grad_density}+zstd:1"
    sr = f"expert_gather: '{gather}', expert_grad: '{grad}'"
    if a.dense_grad == "bf16":
        sr += ", dense_grad: bf16"
    variants = [("ep", "ep", ""), ("hybrid", "auto", ""), ("hybrid+sr", "auto", sr)]
    points = [(layout, int(ff), a.batch) for layout in a.layouts.split(",") for ff in a.ff.split(",")]
    if a.table5_point:
        points.append(("4x2", 64, 32))
    rows = []
    for layout, ff, batch in points:
        for round_no in range(1, a.rounds + 1):
            for name, mode, codecs in variants:
                rows.append(run(a, name, layout, ff, batch, mode, codecs, round_no))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sr_end_to_end.csv"), "w") as f:
        keys = list(rows[0].keys())
        f.write(",".join(keys) + "\n")
        for r in rows:
            f.write(",".join(f"{r[k]:.6g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + "\n")
    lines = [f"{'layout':6s} {'expert':>8s} {'tokens':>6s} {'EP ms':>8s} {'Hyb ms':>8s} {'Hyb+SR ms':>9s} "
             f"{'dom':>4s} {'dom+SR':>6s} {'SR/EP':>6s} {'SR/Hyb':>6s} {'dc MB EP/Hyb/SR':>18s} {'step/bound EP/Hyb/SR':>21s}"]
    dat = os.path.join(a.out, "sr_end_to_end.dat")
    with open(dat, "w") as f:
        for layout, ff, batch in points:
            at_point = [r for r in rows if r["layout"] == layout and r["ff"] == ff and r["tokens_per_worker"] == batch * 64]
            ep, hy, srr = (over_rounds([r for r in at_point if r["variant"] == v]) for v in ("ep", "hybrid", "hybrid+sr"))
            lines.append(f"{layout:6s} {ep['expert_KB']:6.0f}KB {batch*64:6d} {ep['median_step_s']*1e3:8.1f} "
                         f"{hy['median_step_s']*1e3:8.1f} {srr['median_step_s']*1e3:9.1f} {hy['domains']:>4s} {srr['domains']:>6s} "
                         f"{ep['median_step_s']/srr['median_step_s']:5.2f}x {hy['median_step_s']/srr['median_step_s']:5.2f}x "
                         f"{ep['dc_MB_per_step']:5.2f}/{hy['dc_MB_per_step']:5.2f}/{srr['dc_MB_per_step']:5.2f} "
                         f"{ep['step_over_bound']:6.2f}/{hy['step_over_bound']:5.2f}/{srr['step_over_bound']:5.2f}")
            if a.rounds > 1:
                by_round = {(r["round"], r["variant"]): r["median_step_s"] for r in at_point}
                ratios = [by_round[(k, "ep")] / by_round[(k, "hybrid+sr")] for k in range(1, a.rounds + 1)]
                lines.append(f"{'':6s} SR/EP by round: " + ", ".join(f"{x:.2f}x" for x in ratios) +
                             f" (median {median(ratios):.2f}x)")
            if batch == a.batch:
                f.write(f"{layout} {ep['expert_KB']} {ep['median_step_s']*1e3} {hy['median_step_s']*1e3} {srr['median_step_s']*1e3}\n")
    text = "\n".join(lines)
    print("\n" + text)
    with open(os.path.join(a.out, "sr_end_to_end.txt"), "w") as f:
        f.write(text + "\n")
    png = os.path.join(a.out, "sr_end_to_end.png")
    plots = []
    for layout in a.layouts.split(","):
        for col, title in ((3, "EP"), (4, "HybridEP"), (5, "HybridEP+SR")):
            plots.append(f"'< grep ^{layout} {dat}' using 2:{col} with linespoints title '{title} {layout}'")
    script = f"""set terminal pngcairo size 900,520
set output '{png}'
set title 'Step time vs expert size, {a.batch * 64} tokens per worker, inter-DC {a.dc_bandwidth} {a.dc_latency}'
set xlabel 'expert size (KB)'
set ylabel 'median step time (ms)'
set logscale xy 2
set key left top
set grid
plot {", ".join(plots)}
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"\nwrote {a.out}/sr_end_to_end.csv, .txt, .png")


if __name__ == "__main__":
    main()
