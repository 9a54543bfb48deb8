#!/usr/bin/env python3
"""collective_mpi: the OpenMPI baseline for bench/collective_bench.cc.

Run under mpirun, one process per rank, over TCP loopback only:
  mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl tcp,self \
         --mca btl_tcp_if_include lo -np 4 python3 bench/collective_mpi.py --sizes 1,4,16,64

Same definitions as collective_bench.cc (S = MB * 2**20 bytes per rank):
  all_to_allv  Alltoall on a uint8 send buffer of S bytes = world blocks of S/world
  all_gather   Allgather of S bytes per rank into world*S bytes
  all_reduce   Allreduce(SUM) of S/4 float32, in place
One timed iteration = Barrier, then the collective; a rank's sample is its own
time after the barrier; the iteration time is the max over ranks; the reported
time is the median over iterations. algbw = S / time in MB/s (MB = 2**20 B).
Rank 0 prints a table and appends CSV lines (no header) to --csv:
  impl,op,world,mb_per_rank,seconds,algbw_MBps,min_seconds,iters
and with --samples one line per timed iteration: impl,op,world,mb_per_rank,seconds
"""
import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ops", default="all_to_allv,all_gather,all_reduce")
    ap.add_argument("--csv", default="")
    ap.add_argument("--samples", default="", help="append impl,op,world,mb_per_rank,seconds per iteration")
    ap.add_argument("--impl", default="openmpi")
    a = ap.parse_args()

    comm = MPI.COMM_WORLD
    n, me = comm.Get_size(), comm.Get_rank()
    sizes = [int(s) for s in a.sizes.split(",")]
    ops = a.ops.split(",")
    rows = []
    comm.Barrier()
    for mb in sizes:
        S = mb << 20
        for op in ops:
            if op == "all_to_allv":
                send = np.empty(S, dtype=np.uint8)
                for j in range(n):
                    send[j * (S // n):(j + 1) * (S // n)] = (me * 31 + j * 7 + 1) & 0xFF
                recv = np.zeros(S, dtype=np.uint8)
                run = lambda: comm.Alltoall(send, recv)
            elif op == "all_gather":
                send = np.full(S, me + 1, dtype=np.uint8)
                recv = np.zeros(S * n, dtype=np.uint8)
                run = lambda: comm.Allgather(send, recv)
            elif op == "all_reduce":
                data = np.zeros(S // 4, dtype=np.float32)
                run = lambda: comm.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)
            else:
                sys.exit("unknown op " + op)
            for _ in range(a.warmup):
                comm.Barrier()
                run()
            if a.warmup and op == "all_to_allv":
                assert all(recv[i * (S // n)] == ((i * 31 + me * 7 + 1) & 0xFF) for i in range(n))
            if a.warmup and op == "all_gather":
                assert all(int(recv[i * S]) == i + 1 and int(recv[(i + 1) * S - 1]) == i + 1 for i in range(n))
            samples = []
            for _ in range(a.iters):
                comm.Barrier()
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
            mine = np.array(samples, dtype=np.float64)
            mx = np.empty_like(mine)
            comm.Allreduce(mine, mx, op=MPI.MAX)
            rows.append((op, mb, statistics.median(mx.tolist()), float(mx.min()), mx.tolist()))
            if me == 0:
                print(f"  [{a.impl} n={n}] {op:<11} {mb:3d} MB: median {rows[-1][2]:.4f} s (samples: "
                      + " ".join(f"{s:.4f}" for s in mx.tolist()) + ")", file=sys.stderr, flush=True)
            del run
    comm.Barrier()
    if me == 0:
        print(f"collective_mpi ({a.impl}, OpenMPI {MPI.Get_library_version().split(',')[0].strip()}): world {n}, "
              f"{a.iters} timed iterations (+{a.warmup} warm-up), TCP loopback")
        print(f"{'op':<12} {'MB/rank':>6} {'median s':>12} {'min s':>12} {'algbw MB/s':>14}")
        for op, mb, med, mn, _ in rows:
            print(f"{op:<12} {mb:6d} {med:12.5f} {mn:12.5f} {mb / med:14.1f}")
        if a.csv:
            with open(a.csv, "a") as f:
                for op, mb, med, mn, _ in rows:
                    f.write(f"{a.impl},{op},{n},{mb},{med},{mb / med},{mn},{a.iters}\n")
        if a.samples:
            with open(a.samples, "a") as f:
                for op, mb, _, _, xs in rows:
                    for x in xs:
                        f.write(f"{a.impl},{op},{n},{mb},{x:.9f}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
