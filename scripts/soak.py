#!/usr/bin/env python3
"""Soak test: the built-in 2 DC x 2 worker job (HybridEP, FarSkip overlapped,
links shaped to 100 Mbit/s + 10 ms between DCs) trains for a long while --
20 minutes by default -- with checkpoints, and one worker's inter-DC link is
throttled hard (5 Mbit/s) for a quarter of the run. Checks that

  * memory stays flat: every worker's RSS at the end is within 5% of its RSS
    after warm-up (the median of the samples 10-20% into the run vs the
    median of the last 10%);
  * no message is lost: for every pair of workers, the messages and bytes one
    sent are the messages and bytes the other received (each worker logs its
    link counters when it leaves);
  * the run ends on its own, ok.

  python3 scripts/soak.py [--minutes 20] [--xdmoe build/xdmoe]

Writes bench/results/soak.csv (one row per RSS sample) and soak.txt (the
verdict and the figures); runs go to runs/soak/. Exit code 0 when every check
holds, 1 otherwise.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def status(xdmoe, cli):
    out = subprocess.run([xdmoe, "status", "--json", "--coordinator", cli], capture_output=True, text=True, timeout=20)
    return json.loads(out.stdout) if out.returncode == 0 else None


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--xdmoe", default="build/xdmoe")
    ap.add_argument("--run-dir", default="runs/soak")
    ap.add_argument("--out", default="bench/results/soak")
    ap.add_argument("--mode", default="auto+farskip")
    ap.add_argument("--throttle", default="5mbit", help="the hard throttle of one worker's inter-DC link")
    args = ap.parse_args()
    xdmoe = os.path.abspath(args.xdmoe)
    os.makedirs(args.run_dir, exist_ok=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)

    # How many steps fill the time: a short run of the same job first.
    cal = subprocess.run([xdmoe, "launch", "--mode", args.mode, "--steps", "12", "--run-dir", args.run_dir + "/calibrate",
                          "--cli-bind", "tcp://127.0.0.1:*"], capture_output=True, text=True)
    name = args.mode
    summary = json.load(open(f"{args.run_dir}/calibrate/{name}/summary.json"))
    step_s = summary["mean_step_s"]
    steps = max(50, int(args.minutes * 60 / step_s))
    print(f"soak: {steps} steps of about {step_s * 1e3:.0f} ms (calibrated), about {args.minutes:.0f} min", flush=True)

    cli = "tcp://127.0.0.1:7390"
    run_dir = args.run_dir + "/run"
    log = open(args.run_dir + "/launch.log", "w")
    launch = subprocess.Popen([xdmoe, "launch", "--mode", args.mode, "--steps", str(steps), "--run-dir", run_dir,
                               "--cli-bind", cli, "--checkpoint-dir", args.run_dir + "/checkpoints",
                               "--checkpoint-every", "250"],
                              stdout=log, stderr=subprocess.STDOUT)
    samples = []  # (seconds, step, rank, rss)
    start = time.time()
    throttled = restored = False
    total = args.minutes * 60
    next_sample = start
    while launch.poll() is None:
        now = time.time()
        if now >= next_sample:
            next_sample = now + 10
            s = status(xdmoe, cli)
            if s:
                step = s.get("last_step", {}).get("step", 0)
                for w in s.get("workers", []):
                    r = rss_bytes(w.get("pid", 0))
                    if r:
                        samples.append((now - start, step, w["rank"], r))
        if not throttled and now - start > 0.30 * total:
            subprocess.run([xdmoe, "throttle", "--coordinator", cli, "--link", "dc", "--bandwidth", args.throttle,
                            "--rank", "1"], check=False)
            print(f"soak: worker 1's inter-DC link throttled to {args.throttle} at {now - start:.0f} s", flush=True)
            throttled = True
        if throttled and not restored and now - start > 0.55 * total:
            subprocess.run([xdmoe, "throttle", "--coordinator", cli, "--link", "dc", "--bandwidth", "100mbit",
                            "--rank", "1"], check=False)
            print(f"soak: worker 1's inter-DC link back to 100mbit at {now - start:.0f} s", flush=True)
            restored = True
        time.sleep(0.5)
    log.close()
    elapsed = time.time() - start
    code = launch.returncode

    with open(args.out + ".csv", "w") as f:
        f.write("seconds,step,rank,rss_bytes\n")
        for t, step, rank, r in samples:
            f.write(f"{t:.1f},{step},{rank},{r}\n")

    lines = [f"soak: {args.mode}, {steps} steps in {elapsed / 60:.1f} min, launch exit code {code}",
             f"  worker 1's inter-DC link at {args.throttle} from 30% to 55% of the planned time"]
    ok = code == 0
    # RSS: after warm-up vs the end, per worker.
    growth = {}
    for rank in sorted({s[2] for s in samples}):
        mine = [s for s in samples if s[2] == rank]
        n = len(mine)
        warm = [s[3] for s in mine[int(0.10 * n):max(int(0.20 * n), int(0.10 * n) + 1)]]
        end = [s[3] for s in mine[int(0.90 * n):]]
        if warm and end:
            g = statistics.median(end) / statistics.median(warm) - 1
            growth[rank] = g
            lines.append(f"  worker {rank}: RSS {statistics.median(warm) / 1e6:.1f} MB after warm-up, "
                         f"{statistics.median(end) / 1e6:.1f} MB at the end ({g * 100:+.2f}%), "
                         f"max {max(s[3] for s in mine) / 1e6:.1f} MB, {n} samples")
    rss_ok = len(growth) == 4 and all(g < 0.05 for g in growth.values())
    ok = ok and rss_ok
    # Counters: what a sent b equals what b received from a.
    counters = {}
    for rank in range(4):
        text = open(f"{run_dir}/{name}/worker{rank}.log").read()
        m = re.findall(r"link counters: (\[.*\])", text)
        if m:
            counters[rank] = {l["peer"]: l for l in json.loads(m[-1])}
    pairs = mismatches = 0
    messages = 0
    for a in counters:
        for b, la in counters[a].items():
            lb = counters.get(b, {}).get(a)
            pairs += 1
            messages += la["messages_sent"]
            if not lb or lb["messages_received"] != la["messages_sent"] or lb["bytes_received"] != la["bytes_sent"]:
                mismatches += 1
                lines.append(f"  MISMATCH {a} -> {b}: sent {la['messages_sent']} msgs / {la['bytes_sent']} B, "
                             f"received {lb and lb['messages_received']} msgs / {lb and lb['bytes_received']} B")
    counters_ok = len(counters) == 4 and pairs == 12 and mismatches == 0
    ok = ok and counters_ok
    lines.append(f"  links: {pairs} directed pairs, {messages} messages sent, {mismatches} mismatches "
                 f"(sent == received for every pair: {'yes' if counters_ok else 'NO'})")
    try:
        final = json.load(open(f"{run_dir}/{name}/summary.json"))
        lines.append(f"  final loss {final.get('final_loss', float('nan')):.4f}; mean step {final['mean_step_s'] * 1e3:.1f} ms, "
                     f"step / bound {final['step_over_bound']:.2f}, overlap {final['overlap_percent']:.0f}%; "
                     f"{len(final.get('checkpoints', []))} checkpoints")
    except (OSError, KeyError, ValueError):
        ok = False
    lines.append(f"  RSS flat (< 5% growth after warm-up): {'yes' if rss_ok else 'NO'}")
    lines.append(f"verdict: {'PASS' if ok else 'FAIL'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    open(args.out + ".txt", "w").write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
