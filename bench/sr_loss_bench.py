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
A codec schedule (`PIPELINE@STEP:PIPELINE`) is written for 300 steps; with
--steps N it switches at the same fraction of the run (step * N / 300), as the
learning rate's schedule stretches with the run.

usage: python3 bench/sr_loss_bench.py [--xdmoe build/xdmoe] [--steps 200]
           [--spread 0.2] [--runs raw,sr50,...] [--seed S] [--lr LR] [--out bench/results]
           [--name sr_loss] [--work DIR] [--no-held-out] [--cli-bind ENDPOINT]
Writes <out>/sr_loss.csv (one row per run: final loss, mean loss of the last
50 steps, expert-gather bytes and ratio, NMSE, held-out loss),
<out>/sr_loss_curves.csv (every step) and <out>/sr_loss.png (gnuplot).

Two losses per run. "last-50" is the training loss of the last 50 steps as
the run logged it: each worker reads it through the replicas it holds, so a
lossy codec's replica error is in it. "held-out" scores the trained model --
the owners' exact weights, from the run's final checkpoint -- on the 5% of
the corpus no run trains on (`xdmoe forward --held-out`).
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
    # 1-bit values (sign x the row's mean magnitude): about 2.5x the entries of
    # a bf16 top-k for the same bytes.
    # A control: every entry kept (bf16) with feedback, NMSE ~1e-6: what the SR
    # path costs apart from what the codec drops.
    "sr-ef-all": {"expert_gather": "sr:ef:topk:1+zstd:1"},
    "sr25-ef-sign": {"expert_gather": "sr:ef:topk_sign:0.2+zstd:1"},
    "sr50-ef-sign": {"expert_gather": "sr:ef:topk_sign:0.1+zstd:1"},
    "sr100-ef-sign": {"expert_gather": "sr:ef:topk_sign:0.05+zstd:1"},
    # Denser signs: the larger half of the entries (~17x), and every entry
    # (~32x: one bit each; the index gaps are all 1 and zstd removes them).
    "sr-ef-sign-half": {"expert_gather": "sr:ef:topk_sign:0.5+zstd:1"},
    "sr-ef-sign-all": {"expert_gather": "sr:ef:topk_sign:1+zstd:1"},
    # A schedule: every sign while the learning rate is high (steps 0-130 of
    # 300), the largest 5% of the signs after; 50x over the 300 steps.
    "sr-ef-sign-sched50": {"expert_gather": "sr:ef:topk_sign:1+zstd:1@131:topk_sign:0.05+zstd:1"},
    # Signs of the larger half of each tensor's blocks of 16 (or 8) entries:
    # the larger entries corrected every step, at a bit per block instead of
    # an index per entry (~57x; ~51x with blocks of 8).
    "sr-ef-block-half": {"expert_gather": "sr:ef:block_sign:0.5+zstd:1"},
    "sr-ef-block-half-8": {"expert_gather": "sr:ef:block_sign:0.5:8+zstd:1"},
    "sr-ef-pred-block-half": {"expert_gather": "sr:ef:pred:block_sign:0.5+zstd:1"},
    "sr-ef-block-3of8-4": {"expert_gather": "sr:ef:block_sign:0.375:4+zstd:1"},
    "sr-ef-block-60-32": {"expert_gather": "sr:ef:block_sign:0.6:32+zstd:1"},
    # The same with the SR base's changes crossing the DC link as signs
    # (expert_parallel.base_codec: sign, about 1/15 of bf16's bytes).
    "sr-ef-sign-all-basesign": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "base_codec": "sign"},
    "sr-ef-block-half-basesign": {"expert_gather": "sr:ef:block_sign:0.5+zstd:1", "base_codec": "sign"},
    # The same with the SR base re-synchronised every 10 steps, not every step.
    "sr-ef-sign-all-base10": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "base_every": "10"},
    # The same bytes, each entry's drift predicted between its corrections.
    "sr50-ef-pred-sign": {"expert_gather": "sr:ef:pred:topk_sign:0.1+zstd:1"},
    "sr100-ef-pred-sign": {"expert_gather": "sr:ef:pred:topk_sign:0.05+zstd:1"},
    # Every sign, the sign-coded base, replica gradients top-k 10% with
    # feedback and dense gradients in bf16: bench/sr_end_to_end.py's
    # --sign --density 1 --base-every 1 --base-codec sign --dense-grad bf16.
    "e2e-sign-all": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "expert_grad": "ef:topk:0.1+zstd:1",
                     "dense_grad": "bf16", "base_codec": "sign"},
    # Every sign and the sign-coded base, with the replica gradients in int8
    # rows (about 7x with zstd) or as every sign (32x), both with feedback; dense gradients
    # raw, or bf16 (MegaScale-MoE Sec. 5): bench/sr_end_to_end.py's --sign
    # --density 1 --base-every 1 --base-codec sign --expert-grad SPEC
    # [--dense-grad bf16].
    "e2e-sign-int8grad": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "expert_grad": "ef:int8_row+zstd:1",
                          "base_codec": "sign"},
    "e2e-sign-int8grad-bf16dense": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "expert_grad": "ef:int8_row+zstd:1",
                                    "dense_grad": "bf16", "base_codec": "sign"},
    "e2e-sign-signgrad": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "expert_grad": "ef:topk_sign:1+zstd:1",
                          "base_codec": "sign"},
    # The same with the replica gradients as 4-bit integers on a row's scale
    # (int4_row, about 14x with zstd), with feedback.
    "e2e-sign-int4grad": {"expert_gather": "sr:ef:topk_sign:1+zstd:1", "expert_grad": "ef:int4_row+zstd:1",
                          "base_codec": "sign"},
    # Every entry of the SR residual as a 4-bit integer on a scale per 128
    # entries (int4_row:128, about 9x with zstd), with feedback; the replica
    # gradients in int8 rows with feedback, the dense gradients in bf16 and
    # the base (bf16) every 4 steps: bench/sr_end_to_end.py's --expert-gather
    # 'sr:ef:int4_row:128+zstd:1' --expert-grad 'ef:int8_row+zstd:1'
    # --dense-grad bf16 --base-every 4.
    "e2e-int4-int8grad": {"expert_gather": "sr:ef:int4_row:128+zstd:1", "expert_grad": "ef:int8_row+zstd:1",
                          "dense_grad": "bf16", "base_every": "4"},
    # The same with the base every 10 steps (--base-every 10).
    "e2e-int4-int8grad-base10": {"expert_gather": "sr:ef:int4_row:128+zstd:1", "expert_grad": "ef:int8_row+zstd:1",
                                 "dense_grad": "bf16", "base_every": "10"},
    # The same with the replica gradients also as 4-bit integers on a scale
    # per 128 entries (ef:int4_row:128+zstd:1, about 10x against int8's 7x).
    "e2e-int4-int4grad-base10": {"expert_gather": "sr:ef:int4_row:128+zstd:1",
                                 "expert_grad": "ef:int4_row:128+zstd:1", "dense_grad": "bf16", "base_every": "10"},
    # The same with a schedule on the all-gather: 4-bit residuals while the
    # learning rate is high (steps 0-130), every sign after.
    "e2e-int4-sign-sched": {"expert_gather": "sr:ef:int4_row:128+zstd:1@131:topk_sign:1+zstd:1",
                            "expert_grad": "ef:int4_row:128+zstd:1", "dense_grad": "bf16", "base_every": "10"},
    # The same switching to every sign earlier, from step 61.
    "e2e-int4-sign-sched61": {"expert_gather": "sr:ef:int4_row:128+zstd:1@61:topk_sign:1+zstd:1",
                              "expert_grad": "ef:int4_row:128+zstd:1", "dense_grad": "bf16", "base_every": "10"},
    # What bench/sr_end_to_end.py sends across the DCs for HybridEP + SR.
    "e2e-sr": {"expert_gather": "sr:ef:topk:0.04+zstd:1", "expert_grad": "ef:topk:0.1+zstd:1", "base_every": "10"},
}
TAIL = 50  # steps averaged for the final loss: one step's loss is noisy


def scaled_schedule(spec, steps):
    """A schedule's switch steps (`@STEP:`) are written for 300 steps; a run of
    another length switches at the same fraction of its steps, as its learning
    rate schedule stretches with it."""
    return re.sub(r"@(\d+):", lambda m: "@%d:" % round(int(m.group(1)) * steps / 300), spec)


def job_yaml(base, run, steps, spread, seed=1, checkpoint_dir=None, lr=None):
    codecs = {k: scaled_schedule(v, steps) for k, v in run.items() if k not in ("domains", "base_every", "base_codec")}
    y = base
    if lr:  # the peak rate; the floor keeps the config's tenth of it
        y = re.sub(r"\n  learning_rate: .*", "\n  learning_rate: %g" % lr, y, count=1)
        y = re.sub(r"\n  min_learning_rate: .*", "\n  min_learning_rate: %g" % (lr / 10), y, count=1)
    y = y.replace("  connectivity: regular", "  connectivity: regular\n  expert_init_spread: %g" % spread)
    y = re.sub(r"steps: \d+", "steps: %d" % steps, y, count=1)
    y = re.sub(r"\n  seed: \d+", "\n  seed: %d" % seed, y, count=1)
    y = y.replace("log_every: 10", "log_every: 50").replace("eval_every: 30", "eval_every: 0")
    if checkpoint_dir:
        y = y.replace("checkpoint_every: 0", "checkpoint_every: %d" % steps)
        y = re.sub(r"checkpoint_dir: .*", "checkpoint_dir: %s" % checkpoint_dir, y, count=1)
    c = ", ".join("%s: '%s'" % kv for kv in codecs.items())
    dc = "link: {bandwidth: 100mbit, latency: 10ms, shape: false%s}" % (", codecs: {%s}" % c if c else "")
    y = y.replace("link: {bandwidth: 100mbit, latency: 10ms, shape: true}", dc, 1)
    y = y.replace("link: {bandwidth: 1gbit, latency: 0.2ms, shape: true}",
                  "link: {bandwidth: 1gbit, latency: 0.2ms, shape: false}")
    y = y.replace("mode: auto ", "mode: hybrid")
    y = re.sub(r"(    memory_cap: .*\n)", r"\g<1>    base_sync_every: %s\n    base_codec: %s\n" %
               (run.get("base_every", "1"), run.get("base_codec", "bf16")), y, count=1)
    y = y.replace("domain_sizes: [1, 1]", "domain_sizes: %s" % run.get("domains", "[2, 2]"))
    return y


def plot_curves(curve_path, png, names):
    """Loss curves (10-step running mean) from the curves CSV: all steps on the
    left, the second half zoomed on the right."""
    lines = open(curve_path).read().split("\n")[1:]
    rows = [[float(x) for x in l.split(",")] for l in lines if l]
    dat = png[:-4] + ".dat"
    with open(dat, "w") as f:
        for i in range(len(rows)):
            window = rows[max(0, i - 9):i + 1]
            f.write("%d %s\n" % (rows[i][0], " ".join("%.5f" % (sum(r[j] for r in window) / len(window))
                                                       for j in range(1, len(rows[i])))))
    half = len(rows) // 2
    plots = ", ".join("'%s' using 1:%d with lines lw 2 dt %d title '%s'" % (dat, j + 2, 2 if n.endswith("-ef") else 1, n)
                      for j, n in enumerate(names))
    script = """set terminal pngcairo size 1400,600
set output '%s'
set multiplot layout 1,2 title 'Training loss (10-step running mean), 2 DC x 2 workers, HybridEP [2,2], codecs on the inter-DC link'
set xlabel 'step'
set ylabel 'loss'
set grid
set key right top
plot %s
set xrange [%d:*]
set key right top
plot %s
unset multiplot
""" % (png, plots, half, plots)
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--spread", type=float, default=0.2)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--work", default="runs/sr_loss_bench")
    ap.add_argument("--name", default="sr_loss", help="prefix of the output files")
    ap.add_argument("--seed", type=int, default=1, help="train.seed (initial weights and batch order)")
    ap.add_argument("--lr", type=float, default=None,
                    help="train.learning_rate (peak) instead of the config's 3e-3; the floor is a tenth of it")
    ap.add_argument("--plot-only", action="store_true", help="redraw <name>.png from <name>_curves.csv")
    ap.add_argument("--cli-bind", default="tcp://127.0.0.1:7370",
                    help="the coordinator's CLI endpoint (another one lets two benches run at once)")
    ap.add_argument("--no-held-out", action="store_true",
                    help="skip the final checkpoint and its held-out loss")
    a = ap.parse_args()
    if a.plot_only:
        curve_path = os.path.join(a.out, a.name + "_curves.csv")
        plot_curves(curve_path, os.path.join(a.out, a.name + ".png"), open(curve_path).readline().strip().split(",")[1:])
        return
    base = open(os.path.join(os.path.dirname(__file__), "..", "examples", "2dc.yaml")).read()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    rows, curves = [], {}
    names = a.runs.split(",")
    for i, name in enumerate(names):
        cfg = os.path.join(a.work, name + ".yaml")
        run_dir = os.path.join(a.work, name)
        ckpt = None if a.no_held_out else os.path.abspath(os.path.join(run_dir, "checkpoints"))
        with open(cfg, "w") as f:
            f.write(job_yaml(base, RUNS[name], a.steps, a.spread, a.seed, ckpt, a.lr))
        print("[%d/%d] %s: %d steps ..." % (i + 1, len(names), name, a.steps), flush=True)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        p = subprocess.run([a.xdmoe, "launch", "--config", cfg, "--run-dir", run_dir, "--cli-bind", a.cli_bind],
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
        rows[-1]["held_out_loss"] = 0.0
        if ckpt:
            step_dir = os.path.join(ckpt, "step_%06d" % a.steps)
            f = subprocess.run([a.xdmoe, "forward", "--checkpoint", step_dir, "--held-out", cfg], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            m = re.search(r"tokens held out, loss ([0-9.]+)", f.stdout)
            if f.returncode != 0 or not m:
                sys.exit("%s: held-out loss failed:\n%s" % (name, f.stdout[-3000:]))
            rows[-1]["held_out_loss"] = float(m.group(1))
        curves[name] = losses
        print("    mean loss of the last %d steps %.4f, held-out %.4f, expert gather %.1fx, NMSE %.4f" %
              (TAIL, rows[-1]["tail_loss"], rows[-1]["held_out_loss"], rows[-1]["expert_gather_ratio"],
               rows[-1]["nmse"]), flush=True)
    ref = next((r["tail_loss"] for r in rows if r["run"] == "raw"), None)
    ref_held = next((r["held_out_loss"] for r in rows if r["run"] == "raw"), None)
    with open(os.path.join(a.out, a.name + ".csv"), "w") as f:
        keys = list(rows[0].keys()) + ["vs_raw_percent", "held_out_vs_raw_percent"]
        f.write(",".join(keys) + "\n")
        for r in rows:
            r["vs_raw_percent"] = 100.0 * (r["tail_loss"] / ref - 1) if ref else 0.0
            r["held_out_vs_raw_percent"] = 100.0 * (r["held_out_loss"] / ref_held - 1) if ref_held else 0.0
            f.write(",".join(str(round(r[k], 6)) if isinstance(r[k], float) else str(r[k]) for k in keys) + "\n")
    curve_path = os.path.join(a.out, a.name + "_curves.csv")
    with open(curve_path, "w") as f:
        f.write("step," + ",".join(names) + "\n")
        for step in range(a.steps):
            f.write("%d,%s\n" % (step + 1, ",".join("%.5f" % curves[n][step] for n in names)))
    print("%-15s %10s %10s %9s %9s %9s %9s %8s %9s" % ("run", "last-%d" % TAIL, "vs raw %", "held-out", "vs raw %",
          "AG ratio", "AG MB", "base MB", "NMSE"))
    for r in rows:
        print("%-15s %10.4f %+10.2f %9.4f %+9.2f %9.1f %9.3f %8.2f %9.4f" % (
              r["run"], r["tail_loss"], r["vs_raw_percent"], r["held_out_loss"], r["held_out_vs_raw_percent"],
              r["expert_gather_ratio"], r["dc_expert_gather_MB"], r["dc_base_MB"], r["nmse"]))
    plot_curves(curve_path, os.path.join(a.out, a.name + ".png"), names)
    print("wrote %s/%s.csv, %s and %s/%s.png" % (a.out, a.name, curve_path, a.out, a.name))


if __name__ == "__main__":
    main()
