#!/usr/bin/env bash
# collective_bench.sh: our collectives (bench/collective_bench.cc, Transport +
# Communicator over loopback TCP) against OpenMPI (bench/collective_mpi.py,
# mpi4py, TCP BTL on loopback) and torch.distributed gloo
# (bench/collective_gloo.py), at 4 and 8 processes, 1..64 MB per rank.
#
# Interleaving: for each world size, ROUNDS rounds; each round launches the
# three implementations once (all sizes and ops per launch, ITERS timed
# iterations + WARMUP warm-ups each), in an order that rotates from round to
# round, so slow drift and noise hit all three alike. The reported time of a
# point is the median of its ROUNDS*ITERS samples (each sample = the max over
# ranks of one iteration); see bench/README.md for the size definitions.
#
# Op all_to_allv_inplace is our all_to_allv with the zero-copy receive
# (Communicator::all_to_allv into ReceivedBlocks); the baselines have a single
# all-to-all, so its row compares it with their all_to_allv (Alltoall,
# all_to_all_single), which then runs once per launch for both rows.
#
# usage: bash bench/collective_bench.sh
# env:   BUILD_DIR (default <repo>/build; collective_bench is built there if
#        missing), WORLDS ("4 8"), SIZES (1,4,16,64), ROUNDS (3), ITERS (3),
#        WARMUP (3), OPS (all_to_allv,all_to_allv_inplace,all_gather,all_reduce),
#        OUT (bench/results/collectives.csv), XDMOE_ARGS (extra flags for our
#        collective_bench, e.g. "--socket-buffer-kb 2048"), QUIET_WAIT (0: before each launch,
#        wait up to this many seconds for the other processes on the machine to
#        use < 25 % of the CPUs; the background load is printed either way)
# Takes about 5 minutes on 2 cores with the defaults (plus any QUIET_WAIT).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$repo/build}"
WORLDS="${WORLDS:-4 8}"
SIZES="${SIZES:-1,4,16,64}"
ROUNDS="${ROUNDS:-3}"
ITERS="${ITERS:-3}"
WARMUP="${WARMUP:-3}"
OPS="${OPS:-all_to_allv,all_to_allv_inplace,all_gather,all_reduce}"
OUT="${OUT:-$repo/bench/results/collectives.csv}"
PY=/usr/bin/python3   # the system python: torch and mpi4py come from Debian packages
LAUNCH_TIMEOUT="${LAUNCH_TIMEOUT:-400}"

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo

if [ ! -x "$BUILD_DIR/collective_bench" ]; then
  echo "building collective_bench in $BUILD_DIR"
  cmake -S "$repo" -B "$BUILD_DIR" -DXD_BUILD_TESTS=OFF >/dev/null
  cmake --build "$BUILD_DIR" --target collective_bench -j2 >/dev/null
fi
command -v mpirun >/dev/null || { echo "mpirun missing: run scripts/install-deps.sh" >&2; exit 1; }
$PY -c "import mpi4py, torch, numpy" || { echo "mpi4py/torch missing: run scripts/install-deps.sh" >&2; exit 1; }

work="$(mktemp -d /tmp/collective_bench.XXXXXX)"
trap 'rm -rf "$work"' EXIT
samples="$work/samples.csv"
: >"$samples"
BASE_OPS="$(tr ',' '\n' <<<"$OPS" | sed 's/^all_to_allv_inplace$/all_to_allv/' | awk '!seen[$0]++' | paste -sd, -)"
common=(--sizes "$SIZES" --iters "$ITERS" --warmup "$WARMUP" --samples "$samples")

run_ours() {  # world
  local n=$1 dir pids=() rc=0
  dir="$(mktemp -d "$work/rdv.XXXX")"
  for ((r = 0; r < n; r++)); do
    timeout "$LAUNCH_TIMEOUT" "$BUILD_DIR/collective_bench" --rank "$r" --world "$n" --rendezvous "$dir" \
      --impl xdmoe --ops "$OPS" "${common[@]}" ${XDMOE_ARGS:-} &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
run_mpi() {
  timeout "$LAUNCH_TIMEOUT" mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl tcp,self \
    --mca btl_tcp_if_include lo -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS -np "$1" \
    $PY "$repo/bench/collective_mpi.py" --impl openmpi --ops "$BASE_OPS" "${common[@]}"
}
run_gloo() {
  timeout "$LAUNCH_TIMEOUT" $PY "$repo/bench/collective_gloo.py" --world "$1" --impl gloo --ops "$BASE_OPS" \
    "${common[@]}"
}

impls=(ours mpi gloo)
start=$(date +%s)
echo "collective_bench.sh: worlds [$WORLDS], sizes $SIZES MB/rank, ops $OPS, $ROUNDS rounds x $ITERS iterations (+$WARMUP warm-up)"
echo "host: $(getconf _NPROCESSORS_ONLN) cores, $(uname -r); $(mpirun --version 2>/dev/null | head -1); torch $($PY -c 'import torch; print(torch.__version__)')"
# Anything else running skews the comparison (OpenMPI's busy-polling most of
# all): the CPU use of other processes is sampled for 1 s before each launch
# (while we are idle) and printed; the worst sample is reported at the end.
QUIET_WAIT="${QUIET_WAIT:-0}"
busy_pct() {  # share of all CPUs busy over the next second (we are idle between launches)
  local a b
  a=($(head -1 /proc/stat)); sleep 1; b=($(head -1 /proc/stat))
  local idle=$(((b[4] + b[5]) - (a[4] + a[5]))) total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
  echo $((total > 0 ? 100 * (total - idle) / total : 0))
}
wait_quiet() {
  local waited=0 b
  b=$(busy_pct)
  while [ "$b" -ge 25 ] && [ "$waited" -lt "$QUIET_WAIT" ]; do
    sleep 4; waited=$((waited + 5)); b=$(busy_pct)
  done
  echo "    (background CPU use before launch: ${b}%, waited ${waited}s)"
  [ "$b" -gt "$max_bg" ] && max_bg=$b
  return 0
}
max_bg=0
for n in $WORLDS; do
  for ((round = 0; round < ROUNDS; round++)); do
    for ((k = 0; k < 3; k++)); do
      impl=${impls[$(((k + round + n) % 3))]}
      echo "--- world $n, round $((round + 1))/$ROUNDS: $impl ($(($(date +%s) - start)) s elapsed)"
      wait_quiet
      # Per-iteration progress goes to stderr; the per-launch table to stdout.
      "run_$impl" "$n" 2>"$work/err.txt" || { echo "FAILED: $impl world $n" >&2; cat "$work/err.txt" >&2; exit 1; }
      grep -E "^NOTE" "$work/err.txt" || true
    done
  done
done
echo "total benchmark time: $(($(date +%s) - start)) s"
echo "worst background CPU use before a launch: ${max_bg}% of $(getconf _NPROCESSORS_ONLN) cores"
[ "$max_bg" -ge 25 ] && echo "WARNING: other processes were competing for the CPUs; results are noisy (try QUIET_WAIT=120)"

mkdir -p "$(dirname "$OUT")"
$PY - "$samples" "$OUT" "$OPS" <<'EOF'
import collections, statistics, sys
samples, out, requested = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
# The baselines' row that each of our ops is compared with.
baseline_op = {"all_to_allv_inplace": "all_to_allv"}
pts = collections.defaultdict(list)
for line in open(samples):
    impl, op, world, mb, sec = line.strip().split(",")
    pts[(impl, op, int(world), int(mb))].append(float(sec))
med = {k: statistics.median(v) for k, v in pts.items()}
with open(out, "w") as f:
    f.write("impl,op,world,mb_per_rank,seconds,algbw_MBps,min_seconds,samples\n")
    for (impl, op, world, mb), v in sorted(pts.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][3], kv[0][0])):
        m = med[(impl, op, world, mb)]
        f.write(f"{impl},{op},{world},{mb},{m:.6f},{mb / m:.1f},{min(v):.6f},{len(v)}\n")
print()
print("Median time per collective (s) and algbw = MB per rank / time (MB/s, MB = 2^20 B);")
print("ratio = time(ours) / time(baseline): < 1 means ours is faster.")
width = max(12, *(len(op) for op in requested))
hdr = f"{'op':<{width}} {'world':>5} {'MB/rank':>7} | {'xdmoe s':>9} {'openmpi s':>9} {'gloo s':>9} | " \
      f"{'xdmoe MB/s':>10} {'ompi MB/s':>10} {'gloo MB/s':>10} | {'ours/ompi':>9} {'ours/gloo':>9}"
print(hdr)
print("-" * len(hdr))
ops = [op for op in dict.fromkeys(requested) if op in {k[1] for k in pts}]
worlds = sorted({k[2] for k in pts})
sizes = sorted({k[3] for k in pts})
fmt_t = lambda x: f"{x:9.4f}" if x is not None else f"{'n/a':>9}"
fmt_b = lambda mb, x: f"{mb / x:10.1f}" if x is not None else f"{'n/a':>10}"
fmt_r = lambda a, b: f"{a / b:9.2f}" if a is not None and b is not None else f"{'n/a':>9}"
for op in ops:
    for w in worlds:
        for mb in sizes:
            base = baseline_op.get(op, op)
            o = med.get(("xdmoe", op, w, mb))
            m, g = (med.get((i, base, w, mb)) for i in ("openmpi", "gloo"))
            print(f"{op:<{width}} {w:>5} {mb:>7} | {fmt_t(o)} {fmt_t(m)} {fmt_t(g)} | "
                  f"{fmt_b(mb, o)} {fmt_b(mb, m)} {fmt_b(mb, g)} | {fmt_r(o, m)} {fmt_r(o, g)}")
print()
print("Target: our all_to_allv at 16 MB per rank at least as fast as OpenMPI's Alltoall:")
for op in [op for op in ("all_to_allv", "all_to_allv_inplace") if op in requested]:
    for w in worlds:
        o, m = med.get(("xdmoe", op, w, 16)), med.get(("openmpi", "all_to_allv", w, 16))
        if o is None or m is None:
            print(f"  {op:<19} world {w}: not measured")
        else:
            print(f"  {op:<19} world {w}: ours {o:.4f} s vs OpenMPI {m:.4f} s (ratio {o / m:.2f}) -> "
                  f"{'MET' if o <= m else 'NOT MET'}")
print(f"\nwrote {out}")
EOF
