#!/usr/bin/env python3
"""collective_gloo: the torch.distributed (gloo, CPU) baseline for bench/collective_bench.cc.

Spawns --world processes itself (torch.multiprocessing), rendezvous over
init_method tcp://127.0.0.1:PORT; gloo then talks TCP over loopback.
  python3 bench/collective_gloo.py --world 4 --sizes 1,4,16,64

Same definitions as collective_bench.cc (S = MB * 2**20 bytes per rank):
  all_to_allv  all_to_all_single on a uint8 tensor of S bytes = world blocks of S/world
               (if this torch's gloo backend lacks all-to-all, that is reported and the
               op is skipped: the output says so, no row is written)
  all_gather   all_gather of S bytes per rank into a list of world views of one world*S
               buffer (gloo in torch 1.13 lacks all_gather_into_tensor)
  all_reduce   all_reduce(SUM) of S/4 float32, in place
One timed iteration = barrier, then the collective; a rank's sample is its own
time after the barrier; the iteration time is the max over ranks; the reported
time is the median over iterations. algbw = S / time in MB/s (MB = 2**20 B).
Rank 0 prints a table and appends CSV lines (no header) to --csv:
  impl,op,world,mb_per_rank,seconds,algbw_MBps,min_seconds,iters
and with --samples one line per timed iteration: impl,op,world,mb_per_rank,seconds
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(me, a, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=a.world)
    n = a.world
    sizes = [int(s) for s in a.sizes.split(",")]
    ops = a.ops.split(",")
    rows, notes = [], []
    dist.barrier()
    for mb in sizes:
        S = mb << 20
        for op in ops:
            if op == "all_to_allv":
                send = torch.empty(S, dtype=torch.uint8)
                for j in range(n):
                    send[j * (S // n):(j + 1) * (S // n)] = (me * 31 + j * 7 + 1) & 0xFF
                recv = torch.zeros(S, dtype=torch.uint8)
                run = lambda: dist.all_to_all_single(recv, send)
            elif op == "all_gather":
                send = torch.full((S,), me + 1, dtype=torch.uint8)
                recv = torch.zeros(S * n, dtype=torch.uint8)
                # gloo has no _allgather_base (all_gather_into_tensor) in torch 1.13:
                # gather into a list of views of one world*S buffer instead.
                views = list(recv.chunk(n))
                run = lambda: dist.all_gather(views, send)
            elif op == "all_reduce":
                data = torch.zeros(S // 4, dtype=torch.float32)
                run = lambda: dist.all_reduce(data, op=dist.ReduceOp.SUM)
            else:
                sys.exit("unknown op " + op)
            try:
                for _ in range(a.warmup):
                    dist.barrier()
                    run()
            except (RuntimeError, NotImplementedError) as e:
                # Every rank fails alike (backend capability), so all skip together.
                notes.append(f"{op}: not supported by gloo in torch {torch.__version__}: "
                             f"{str(e).splitlines()[0]}")
                dist.barrier()
                continue
            if a.warmup and op == "all_to_allv":
                assert all(int(recv[i * (S // n)]) == ((i * 31 + me * 7 + 1) & 0xFF) for i in range(n))
            if a.warmup and op == "all_gather":
                assert all(int(recv[i * S]) == i + 1 and int(recv[(i + 1) * S - 1]) == i + 1 for i in range(n))
            samples = []
            for _ in range(a.iters):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
            mx = torch.tensor(samples, dtype=torch.float64)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            mx = mx.tolist()
            rows.append((op, mb, statistics.median(mx), min(mx), mx))
            if me == 0:
                print(f"  [{a.impl} n={n}] {op:<11} {mb:3d} MB: median {rows[-1][2]:.4f} s (samples: "
                      + " ".join(f"{s:.4f}" for s in mx) + ")", file=sys.stderr, flush=True)
            del run
    dist.barrier()
    if me == 0:
        print(f"collective_gloo ({a.impl}, torch {torch.__version__} gloo): world {n}, "
              f"{a.iters} timed iterations (+{a.warmup} warm-up), TCP loopback")
        for note in dict.fromkeys(notes):
            print("NOTE: " + note)
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
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", default="1,4,16,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ops", default="all_to_allv,all_gather,all_reduce")
    ap.add_argument("--csv", default="")
    ap.add_argument("--samples", default="", help="append impl,op,world,mb_per_rank,seconds per iteration")
    ap.add_argument("--impl", default="gloo")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(worker, args=(a, a.port or free_port()), nprocs=a.world, join=True,
                       start_method="fork")


if __name__ == "__main__":
    main()
