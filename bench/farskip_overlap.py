#!/usr/bin/env python3
"""FarSkip overlap, end to end (FarSkip-Collective Table 3, FSMoE Sec. 4-5), on
this machine: regular connectivity with the simple schedule (nothing
overlapped, what every step did before overlap existed), FarSkip simple (the
same math, nothing overlapped), FarSkip overlapped with r = 1 and with the
planner's r, and regular connectivity overlapped -- in EP and in HybridEP.

The settings, each on shaped links where communication is comparable to
compute (the ratio, busiest link's transmit time / compute, is measured on
the first run and printed):
  ep      2 DCs x 1 worker (one worker per core), EP, inter-DC 800 Mbit/s, 1 ms
  ep4g    the same at 4 Gbit/s, 1 ms: every transfer fits under the compute
          FarSkip overlaps it with, on paper
  ep400   the same at 400 Mbit/s: its forward stays link-bound when the
          machine is slow (not in the default --settings; see --once)
  eplong  the same at 2 Gbit/s, 1 ms, with sequences of 256 instead of 64
          (the same tokens): 4x the attention to hide each Dispatch under
  eplongbal  eplong with expert-choice routing: every expert, so every
          worker, gets the same number of tokens, so no worker waits for a
          more loaded peer's Combine
  epdeep  eplongbal with 12 layers instead of 4: the same backward tail,
          three times the exchanges to hide (not in the default --settings)
  hybrid  2 DCs x 2 workers (the README demo's job), HybridEP domains [2, 1],
          inter-DC 100 Mbit/s, 10 ms
  hybridfit  the same at 200 Mbit/s, 10 ms: the link's busy time comes to
          about the compute's (not in the default --settings)
  hybrid2x1  2 DCs x 1 worker (one worker per core, as in the EP settings),
          HybridEP with one domain of both workers: each gathers the
          other's experts over the DC link and returns their gradients, and
          no token crosses it; 2048 tokens a step, inter-DC 400 Mbit/s, 1 ms
          (not in the default --settings)
  hybrid2x1dc  the same with a DC's 10 ms of latency (not in the default
          --settings)
Every run is a real `xdmoe launch`: a coordinator and worker processes over
loopback. Figures are means over the steps after two warm-up steps: step
time, speedup over the first run, overlap % per direction, step / bound, and
the planner's prediction (at start-up, live with the compute re-fitted while the
run goes, and again with the whole run's measured compute).

usage: python3 bench/farskip_overlap.py [--xdmoe build/xdmoe] [--steps 20]
           [--settings ep,ep4g,eplong,eplongbal,hybrid] [--trace-step 12] [--out bench/results] [--once]
Writes <out>/farskip_overlap.csv and .txt, and a trace of one step of the
planner's-r FarSkip run of each setting, <out>/farskip_trace_<setting>.png
(scripts/trace_png.py; the Chrome trace JSONs stay in the run directory).
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
  max_seq_len: {seq}
train:
  steps: {{steps}}
  batch_size: {{batch}}
  seq_len: {seq}
  log_every: 100
  eval_every: 0
"""


def ep_setting(bandwidth, seq=64, gating=None, layers=None):
    """2 DCs x 1 worker, EP, the inter-DC link at `bandwidth` and 1 ms;
    2048 tokens a step in sequences of `seq`; `gating` overrides the router,
    `layers` the number of layers (4)."""
    model = MODEL.format(seq=seq)
    if gating:
        model = model.replace("model:\n", "model:\n  gating: %s\n" % gating, 1)
    if layers:
        model = model.replace("model:\n", "model:\n  num_layers: %d\n" % layers, 1)
    return {
        "yaml": model + """cluster:
  levels:
    - name: dc
      size: 2
      link: {{bandwidth: %s, latency: 1ms, shape: true}}
  expert_parallel:
    mode: ep
""" % bandwidth,
        "batch": 2048 // seq,
        "runs": ["ep+simple", "ep+farskip+simple", "ep+farskip+r1", "ep+farskip+r0", "ep+r0"],
    }


SETTINGS = {
    "ep": ep_setting("800mbit"),
    "ep4g": ep_setting("4gbit"),
    # ep at half the bandwidth: its forward stays bound by the link when the
    # machine computes at half speed (a slow period), where +once shows.
    "ep400": ep_setting("400mbit"),
    "eplong": ep_setting("2gbit", seq=256),
    "eplongbal": ep_setting("2gbit", seq=256, gating="expert_choice"),
    # eplongbal three times as deep: the step's tail (the last dense bucket's
    # round trip, which no compute is left to hide) is the same, the
    # exchanges the schedule can hide three times as many.
    "epdeep": ep_setting("2gbit", seq=256, gating="expert_choice", layers=12),
    "hybrid": {
        "yaml": MODEL.format(seq=64) + """cluster:
  expert_parallel:
    mode: hybrid
    domain_sizes: [2, 1]
""",
        "batch": 16,
        "runs": ["hybrid+simple", "hybrid+farskip+simple", "hybrid+farskip+r1", "hybrid+farskip+r0", "hybrid+r0"],
    },
}

# The hybrid setting with the inter-DC link at twice the bandwidth: the link's
# busy time comes to about the compute's (1.03 in a quick period of this
# machine), where the hybrid setting's is well above it.
SETTINGS["hybridfit"] = {
    "yaml": MODEL.format(seq=64) + """cluster:
  levels:
    - name: dc
      size: 2
      link: {{bandwidth: 200mbit, latency: 10ms, shape: true}}
    - name: worker
      size: 2
      link: {{bandwidth: 1gbit, latency: 0.2ms, shape: true}}
  expert_parallel:
    mode: hybrid
    domain_sizes: [2, 1]
""",
    "batch": 16,
    "runs": SETTINGS["hybrid"]["runs"],
}


def hybrid_per_core_setting(latency):
    """2 DCs x 1 worker, HybridEP with domain_sizes [2]: every expert is
    gathered across the DC link, 2048 tokens a step, 400 Mbit/s."""
    return {
        "yaml": MODEL.format(seq=64) + """cluster:
  levels:
    - name: dc
      size: 2
      link: {{bandwidth: 400mbit, latency: %s, shape: true}}
  expert_parallel:
    mode: hybrid
    domain_sizes: [2]
""" % latency,
        "batch": 32,
        "runs": SETTINGS["hybrid"]["runs"],
    }


SETTINGS["hybrid2x1"] = hybrid_per_core_setting("1ms")
SETTINGS["hybrid2x1dc"] = hybrid_per_core_setting("10ms")

LABELS = {
    "simple": "regular, simple",
    "farskip+simple": "FarSkip, simple",
    "farskip+r1": "FarSkip, overlapped, r = 1",
    "farskip+r0": "FarSkip, overlapped, planner's r",
    "r0": "regular, overlapped, planner's r",
    "farskip+r0+once": "FarSkip, ovl., planner's r, once",
    "farskip+r0+perexpert": "FarSkip, ovl., planner's r, per expert",
}


def launch(xdmoe, config, runs, steps, run_dir, trace_step):
    """Runs `runs` in one `xdmoe launch` (config None: the built-in demo job) and returns each run's summary."""
    cmd = [xdmoe, "launch"] + (["--config", config] if config else []) + ["--run-dir", run_dir, "--steps", str(steps)]
    for r in runs:
        cmd += ["--mode", r]
    if trace_step:
        cmd += ["--trace-steps", str(trace_step)]
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    table = out.stdout[out.stdout.rfind("\n                  "):] if out.stdout else ""
    print(table.strip()[-4000:], flush=True)
    if out.returncode != 0:
        sys.exit(f"launch failed ({out.returncode}):\n{out.stderr[-3000:]}")
    summaries = {}
    for r in runs:
        with open(os.path.join(run_dir, r.replace("/", "_"), "summary.json")) as f:  # +r4/2 runs in +r4_2
            summaries[r] = json.load(f)
    return summaries


# The slowest worker's waits by what for (the summary's mean_critical_waits_s,
# docs/overlap.md), in the order they come in a step, with short column names.
WAITS = [("forward/token_exchange", "f:tok"), ("forward/expert_all_gather", "f:ag"),
         ("backward/token_exchange", "b:tok"), ("backward/replica_gradients", "b:rep"),
         ("backward/dense_all_reduce", "b:dense"), ("backward/gradient_norm", "b:norm")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--xdmoe", default="build/xdmoe")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--settings", default="ep,ep4g,eplong,eplongbal,hybrid")
    p.add_argument("--trace-step", type=int, default=12)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--once", action="store_true",
                   help="also run FarSkip overlapped at the planner's r with a token row per expert (+perexpert) "
                        "and with a token once to each worker that computes some of its experts (+once); the "
                        "other runs take the planner's choice (docs/overlap.md)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name in a.settings.split(","):
        s = SETTINGS[name]
        run_dir = os.path.join("runs", "bench_farskip", name)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        config = os.path.join(run_dir, "job.yaml")
        with open(config, "w") as f:
            f.write(s["yaml"].format(steps=a.steps, batch=s["batch"]))
        runs = s["runs"] + ([r + suffix for r in s["runs"] if r.endswith("+farskip+r0")
                             for suffix in ("+perexpert", "+once")] if a.once else [])
        summaries = launch(a.xdmoe, config, runs, a.steps, run_dir, a.trace_step)
        base = summaries[runs[0]]
        ratio = base["mean_link_busy_s"] / base["mean_compute_s"]
        for r in runs:
            j = summaries[r]
            rows.append({
                "setting": name,
                "run": r,
                "schedule": LABELS[r.split("+", 1)[1]],
                "pipeline_degree": j["pipeline_degree"],
                "tokens_once_per_worker": j.get("tokens_once_per_worker", False),
                "link_over_compute": round(ratio, 3),
                "step_ms": round(j["mean_step_s"] * 1e3, 1),
                "speedup": round(base["mean_step_s"] / j["mean_step_s"], 3),
                "compute_ms": round(j["mean_compute_s"] * 1e3, 1),
                "exposed_ms": round(j["mean_exposed_comm_s"] * 1e3, 1),
                "compute_spread_ms": round(j.get("mean_compute_spread_s", 0) * 1e3, 1),
                "fwd_overlap_pct": round(j["fwd_overlap_percent"], 1),
                "bwd_overlap_pct": round(j["bwd_overlap_percent"], 1),
                "critical_fwd_overlap_pct": round(j.get("critical_fwd_overlap_percent", 0), 1),
                "critical_bwd_overlap_pct": round(j.get("critical_bwd_overlap_percent", 0), 1),
                "bound_ms": round(j["bound_s"] * 1e3, 1),
                "step_over_bound": round(j["step_over_bound"], 3),
                "phase_floor_ms": round(j.get("phase_floor_s", 0) * 1e3, 1),
                "step_over_phase_floor": round(j.get("step_over_phase_floor", 0), 3),
                "cpu_floor_ms": round(j.get("cpu_floor_s", 0) * 1e3, 1),
                "step_over_cpu_floor": round(j.get("step_over_cpu_floor", 0), 3),
                "predicted_ms": round(j.get("startup_predicted_step_s", j["predicted_step_s"]) * 1e3, 1),
                "predicted_live_ms": round(j.get("mean_predicted_step_s", 0) * 1e3, 1),
                "predicted_measured_compute_ms": round(j.get("predicted_with_measured_compute_s", 0) * 1e3, 1),
                "final_loss": round(j["final_loss"], 4),
                # Each phase's compute and its busiest link's transmit time.
                "fwd_compute_ms": round(j.get("mean_fwd_compute_s", 0) * 1e3, 1),
                "fwd_comm_ms": round(j.get("mean_fwd_comm_s", 0) * 1e3, 1),
                "bwd_compute_ms": round(j.get("mean_bwd_compute_s", 0) * 1e3, 1),
                "bwd_comm_ms": round(j.get("mean_bwd_comm_s", 0) * 1e3, 1),
            })
            waits = j.get("mean_critical_waits_s", {})
            for key, _ in WAITS:
                rows[-1]["wait_" + key.replace("/", "_") + "_ms"] = round(waits.get(key, 0) * 1e3, 1)
        traced = [r for r in runs if r.endswith("farskip+r0")][0]
        trace_dir = os.path.join(run_dir, traced, "trace")
        png = os.path.join(a.out, f"farskip_trace_{name}.png")
        subprocess.run([sys.executable, "scripts/trace_png.py", trace_dir, "--step", str(a.trace_step), "--out", png,
                        "--title", f"{name}: {LABELS['farskip+r0']}"], check=True)
    keys = list(rows[0].keys())
    with open(os.path.join(a.out, "farskip_overlap.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = []
    header = (f"{'setting':11} {'schedule':38} {'r':>2} {'once':>4} {'step ms':>8} {'speedup':>8} {'fwd ovl%':>8} "
              f"{'bwd ovl%':>8} {'slowest':>11} {'exp ms':>7} {'spread':>7} {'bound ms':>9} {'step/bnd':>8} {'step/flr':>8} {'step/cpu':>8} {'pred ms':>8} {'live ms':>8} "
              f"{'pred*':>7} {'loss':>7}")
    lines.append(header)
    for r in rows:
        lines.append(f"{r['setting']:11} {r['schedule']:38} {r['pipeline_degree']:>2} "
                     f"{'yes' if r['tokens_once_per_worker'] else 'no':>4} {r['step_ms']:>8} "
                     f"{r['speedup']:>7.2f}x {r['fwd_overlap_pct']:>8} {r['bwd_overlap_pct']:>8} "
                     f"{'%.0f/%.0f' % (r['critical_fwd_overlap_pct'], r['critical_bwd_overlap_pct']):>11} "
                     f"{r['exposed_ms']:>7} {r['compute_spread_ms']:>7} {r['bound_ms']:>9} "
                     f"{r['step_over_bound']:>8.2f} {r['step_over_phase_floor']:>8.2f} {r['step_over_cpu_floor']:>8.2f} {r['predicted_ms']:>8} {r['predicted_live_ms']:>8} "
                     f"{r['predicted_measured_compute_ms']:>7} "
                     f"{r['final_loss']:>7}")
    lines.append("")
    lines.append(f"{'setting':11} {'schedule':38} {'r':>2} " + " ".join(f"{short:>7}" for _, short in WAITS) +
                 f" {'fwd c/l':>13} {'bwd c/l':>13}   the slowest worker's waits (ms) by what for; each phase's "
                 "compute / comm")
    for r in rows:
        lines.append(f"{r['setting']:11} {r['schedule']:38} {r['pipeline_degree']:>2} " +
                     " ".join(f"{r['wait_' + key.replace('/', '_') + '_ms']:>7}" for key, _ in WAITS) +
                     f" {'%.1f/%.1f' % (r['fwd_compute_ms'], r['fwd_comm_ms']):>13}"
                     f" {'%.1f/%.1f' % (r['bwd_compute_ms'], r['bwd_comm_ms']):>13}")
    lines.append("")
    for name in a.settings.split(","):
        ratio = [r for r in rows if r["setting"] == name][0]["link_over_compute"]
        lines.append(f"{name}: busiest link's transmit time / compute = {ratio:.2f} (first run)")
    lines.append("fwd/bwd ovl%, exp ms: overlap and exposed communication of the most-waiting worker; slowest: "
                 "fwd/bwd overlap of the slowest worker (the critical path; no spread in its waits); spread: the "
                 "slowest worker's compute minus the fastest's, which the others wait out as exposed time")
    lines.append("f:/b: forward/backward waits of the slowest worker: tok token exchanges, ag gathered experts, rep "
                 "replica gradients, dense the dense buckets after backward, norm the gradient norm's sum "
                 "(docs/overlap.md)")
    lines.append("step/flr: step / phase floor, each phase's own max(compute, link) summed (docs/overlap.md); "
                 "fwd/bwd c/l: that phase's compute / its comm, the busiest link's transmit time (at least the "
                 "exposed time), in ms: the larger one bounds the phase")
    lines.append("step/cpu: step / CPU floor, the workers' CPU time (every thread) over this machine's cores: "
                 "1.00 kept every core busy with the job (docs/overlap.md)")
    lines.append("once: whether a token crossed once to each worker computing some of its experts (the planner's "
                 "choice unless the run says once or per expert; docs/overlap.md)")
    lines.append("pred ms: the start-up plan's prediction; live ms: each step's prediction as it ran, the compute "
                 "re-fitted during the run (docs/planner.md, \"During a run\"); pred*: the prediction again with "
                 "the compute the whole run measured")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "farskip_overlap.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
