#!/usr/bin/env python3
"""Recovery after a lost worker: the time from a worker's death to training
resumed, and the steps computed again.

Runs the built-in 2 DC x 2 worker job (HybridEP, FarSkip overlapped, the
inter-DC link shaped to 100 Mbit/s + 10 ms) with a checkpoint every
--every steps and --max-restarts 1, SIGKILLs one worker (rank and step drawn
from a seeded RNG) --kills times, one job each, and reports per kill:

  detect+restart s  the kill to the first completed step of the relaunched job
                    (the coordinator's first_step_wall_s)
  launch s          the launch's own count, from noticing the failure
  steps lost        the steps computed again: the step the job had reached
                    minus the checkpoint it resumed from
  losses equal      every loss after the resume equals the same job's
                    uninterrupted run (compared on the steps both have)

  python3 bench/recovery_bench.py [--kills 3] [--every 10] [--xdmoe build/xdmoe]

Writes bench/results/recovery.csv and recovery.txt.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--run-dir", default="runs/recovery")
    ap.add_argument("--out", default="bench/results/recovery")
    args = ap.parse_args()
    xdmoe = os.path.abspath(args.xdmoe)
    rng = random.Random(2026)
    mode = "hybrid+farskip+d2x1+r2"  # a fixed plan, so every run computes the same arithmetic
    ref_dir = f"{args.run_dir}/reference"
    subprocess.run([xdmoe, "launch", "--mode", mode, "--steps", str(args.steps), "--run-dir", ref_dir,
                    "--cli-bind", "tcp://127.0.0.1:*", "--no-replan"], capture_output=True, check=True)
    reference = json.load(open(f"{ref_dir}/{mode}/summary.json"))
    ref = dict(zip(reference["steps"], reference["losses"]))
    rows = []
    for k in range(args.kills):
        kill_after = rng.randint(args.every + 2, args.steps - 15)
        victim = rng.randint(0, 3)
        delay = rng.uniform(0, args.every * reference["mean_step_s"])
        run_dir = f"{args.run_dir}/kill{k}"
        cli = f"tcp://127.0.0.1:{7400 + k}"
        p = subprocess.Popen([xdmoe, "launch", "--mode", mode, "--steps", str(args.steps), "--run-dir", run_dir,
                              "--cli-bind", cli, "--no-replan", "--checkpoint-dir", f"{run_dir}-ck",
                              "--checkpoint-every", str(args.every), "--max-restarts", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed_at = 0
        out = []
        for line in p.stdout:
            out.append(line)
            m = re.match(r"step +(\d+)/", line)
            if not killed_at and m and int(m.group(1)) >= kill_after:
                # Progress lines come every 10 steps: wait a random part of a
                # checkpoint interval more, so the kill lands anywhere in it.
                time.sleep(delay)
                s = json.loads(subprocess.run([xdmoe, "status", "--json", "--coordinator", cli],
                                              capture_output=True, text=True).stdout)
                os.kill(s["workers"][victim]["pid"], 9)
                killed_at = time.time()
        p.wait()
        s = json.load(open(f"{run_dir}/{mode}-restart1/summary.json"))
        r = s["restarts"][0]
        equal = all(ref.get(st) == loss for st, loss in zip(s["steps"], s["losses"]))
        rows.append({"kill": k, "victim": victim, "killed_after_step": kill_after,
                     "failed_after_step": r["failed_after_step"], "resumed_step": r["resumed_step"],
                     "steps_lost": r["failed_after_step"] - r["resumed_step"],
                     "detect_restart_s": s["first_step_wall_s"] - killed_at, "launch_s": r["recovery_s"],
                     "losses_equal": equal, "ok": s["ok"] and p.returncode == 0})
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out + ".csv", "w") as f:
        f.write(",".join(rows[0].keys()) + "\n")
        for row in rows:
            f.write(",".join(str(v) for v in row.values()) + "\n")
    lines = [f"recovery_bench: {mode} on the built-in job, {args.steps} steps, a checkpoint every {args.every}, "
             f"mean step {reference['mean_step_s'] * 1e3:.0f} ms (step / bound {reference['step_over_bound']:.2f}, "
             f"overlap {reference['overlap_percent']:.0f}%)",
             f"{'kill':>4} {'rank':>4} {'at step':>7} {'resumed':>7} {'lost':>5} {'kill->step s':>12} {'launch s':>8} {'losses equal':>12}"]
    for r in rows:
        lines.append(f"{r['kill']:>4} {r['victim']:>4} {r['failed_after_step']:>7} {r['resumed_step']:>7} "
                     f"{r['steps_lost']:>5} {r['detect_restart_s']:>12.2f} {r['launch_s']:>8.2f} {str(r['losses_equal']):>12}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    open(args.out + ".txt", "w").write(text)
    return 0 if all(r["ok"] and r["losses_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
