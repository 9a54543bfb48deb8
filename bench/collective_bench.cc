// collective_bench: one rank of a multi-process benchmark of the project's
// collectives (transport/communicator.h) over loopback TCP. Start one process
// per rank (bench/collective_bench.sh does it); they find each other through a
// file rendezvous directory (tests/tools/rendezvous.h).
//
// Sizes are "MB per rank", S = MB * 2^20 bytes, with the SAME meaning as in
// bench/collective_mpi.py and bench/collective_gloo.py (see bench/README.md):
//   all_to_allv  every rank's send buffer holds S bytes, split into `world`
//                equal blocks of S/world bytes (the block for itself included,
//                as in MPI_Alltoall); it receives S bytes.
//   all_to_allv_inplace  the same exchange through the zero-copy overload
//                (transport/received_blocks.h): it ends with the S bytes
//                received readable in place, not copied into one buffer.
//                Compared with the same baselines as all_to_allv.
//   all_gather   every rank contributes S bytes; every rank ends with world*S.
//   all_reduce   every rank holds S bytes of float32 (S/4 floats), summed in place.
// One timed iteration = barrier, then the collective on every rank; a rank's
// sample is its own time from after the barrier until wait() returns, the
// iteration's time is the MAX of the ranks' samples, and the reported time is
// the MEDIAN over the timed iterations. algbw = S / time, in MB/s (MB = 2^20 B).
//
// usage: collective_bench --rank R --world N --rendezvous DIR
//                         [--sizes 1,4,16,64] [--iters K] [--warmup W]
//                         [--ops all_to_allv,all_to_allv_inplace,all_gather,all_reduce]
//                         [--csv FILE] [--samples FILE] [--impl NAME]
//                         [--phases] [--variants] [--malloc-tune]
// Rank 0 prints a table and appends CSV lines to FILE (no header):
//   impl,op,world,mb_per_rank,seconds,algbw_MBps,min_seconds,iters
// and, with --samples, one line per timed iteration (max over ranks):
//   impl,op,world,mb_per_rank,seconds
// --phases additionally prints, for all_to_allv, where the time of rank 0 goes
// (send hand-off, waits for blocks, memcpy out), measured by a copy of the
// algorithm built from the public Transport API (not the timed path).
// --variants (profiling) times, interleaved iteration by iteration, the real
// all_to_allv against prototypes of proposed fixes built from the public
// Transport API (see a2a_variant below and bench/README.md).
// --malloc-tune sets mallopt(M_MMAP_THRESHOLD 32 MB, M_TRIM_THRESHOLD 1 GB) so
// ZeroMQ's receive buffers reuse memory instead of faulting in fresh pages.
// --socket-buffer-kb K sets SO_SNDBUF and SO_RCVBUF of every connection;
// --local-sndbuf-kb K the SO_SNDBUF of connections to this host (default 256,
// TransportOptions::local_send_buffer_bytes); 0 leaves the kernel's autotuning.

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/tools/rendezvous.h"
#include "transport/communicator.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int rank = -1, world = 0;
  std::string dir;
  std::vector<int> sizes_mb = {1, 4, 16, 64};
  int iters = 5, warmup = 1;
  std::vector<std::string> ops = {"all_to_allv", "all_gather", "all_reduce"};
  std::string csv, samples, impl = "xdmoe";
  bool phases = false;
  bool variants = false;    // time prototype all_to_allv variants (profiling)
  bool malloc_tune = false; // mallopt: keep freed memory (no page faults on receive)
  int socket_buffer_kb = 0; // TransportOptions::socket_buffer_bytes / 1024; 0: kernel autotuning
  int local_sndbuf_kb = 256; // TransportOptions::local_send_buffer_bytes / 1024; 0: kernel autotuning
  int io_threads = 1;       // TransportOptions::io_threads (ZeroMQ I/O threads)
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "collective_bench: %s\n"
               "usage: collective_bench --rank R --world N --rendezvous DIR [--sizes 1,4,16,64]\n"
               "       [--iters K] [--warmup W] [--ops all_to_allv,all_to_allv_inplace,all_gather,all_reduce]\n"
               "       [--csv FILE] [--samples FILE] [--impl NAME] [--phases] [--variants]\n"
               "       [--malloc-tune] [--socket-buffer-kb K] [--local-sndbuf-kb K] [--io-threads N]\n",
               msg.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t c = s.find(',', pos);
    out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}

int to_int(const std::string& flag, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < lo || x > hi) usage(flag + ": bad value '" + v + "'");
  return static_cast<int>(x);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--phases") { o.phases = true; continue; }
    if (k == "--variants") { o.variants = true; continue; }
    if (k == "--malloc-tune") { o.malloc_tune = true; continue; }
    if (i + 1 >= argc) usage("missing value for " + k);
    const std::string v = argv[++i];
    if (k == "--rank") o.rank = to_int(k, v, 0, 65534);
    else if (k == "--world") o.world = to_int(k, v, 1, 65535);
    else if (k == "--rendezvous") o.dir = v;
    else if (k == "--iters") o.iters = to_int(k, v, 1, 100000);
    else if (k == "--warmup") o.warmup = to_int(k, v, 0, 100000);
    else if (k == "--csv") o.csv = v;
    else if (k == "--samples") o.samples = v;
    else if (k == "--impl") o.impl = v;
    else if (k == "--socket-buffer-kb") o.socket_buffer_kb = to_int(k, v, 0, 1 << 20);
    else if (k == "--local-sndbuf-kb") o.local_sndbuf_kb = to_int(k, v, 0, 1 << 20);
    else if (k == "--io-threads") o.io_threads = to_int(k, v, 1, 64);
    else if (k == "--sizes") {
      o.sizes_mb.clear();
      for (const auto& s : split(v)) o.sizes_mb.push_back(to_int(k, s, 1, 4096));
    } else if (k == "--ops") {
      o.ops = split(v);
      for (const auto& op : o.ops)
        if (op != "all_to_allv" && op != "all_to_allv_inplace" && op != "all_gather" && op != "all_reduce")
          usage("unknown op " + op);
    } else usage("unknown option " + k);
  }
  if (o.rank < 0 || o.world <= 0 || o.rank >= o.world || o.dir.empty()) usage("need --rank, --world, --rendezvous");
  return o;
}

void die_if(const xd::Status& st, const char* what) {
  if (st.is_ok()) return;
  std::fprintf(stderr, "collective_bench: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Bench {
  Options o;
  xd::Transport* transport;
  xd::Communicator* comm;
  uint32_t step = 1;  // every collective gets its own tag

  xd::CollectiveTag next_tag() { return xd::CollectiveTag{step++, 0, 0}; }
  void barrier() { die_if(comm->barrier(next_tag()).wait(), "barrier"); }

  // Per-iteration samples of all ranks -> max per iteration, on every rank.
  std::vector<double> max_over_ranks(const std::vector<double>& mine) {
    const int n = comm->size();
    std::vector<double> all(mine.size() * n);
    die_if(comm->all_gather(next_tag(), mine.data(), mine.size() * sizeof(double), all.data()).wait(),
           "gathering samples");
    std::vector<double> out(mine.size(), 0.0);
    for (int r = 0; r < n; ++r)
      for (size_t k = 0; k < mine.size(); ++k) out[k] = std::max(out[k], all[r * mine.size() + k]);
    return out;
  }
};

// a2a send block j of rank r is filled with byte (r*31 + j*7 + 1) & 0xFF.
uint8_t a2a_byte(int from, int to) { return static_cast<uint8_t>(from * 31 + to * 7 + 1); }

// The all_to_allv algorithm of transport/communicator.cc rebuilt from the
// public Transport API with timestamps between its phases, to show where the
// time goes. Blocking, one thread.
struct A2aPhases {
  double post = 0, send_handoff = 0, first_block = 0, all_blocks = 0, memcpy_s = 0, sends_done = 0;
};

A2aPhases a2a_with_phases(xd::Transport* t, int me, int n, uint32_t step, const uint8_t* send,
                          size_t block, uint8_t* recv) {
  A2aPhases p;
  auto now = [t0 = Clock::now()] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const xd::Tag tag{xd::MessageKind::kAllToAll, step, 7, 7, 0};
  std::vector<std::shared_ptr<xd::RecvSlot>> slots(n);
  for (int i = 0; i < n; ++i) slots[i] = t->recv(i, tag);
  p.post = now();
  std::vector<std::shared_ptr<xd::Completion>> sends;
  for (int k = 0; k < n; ++k) {
    const int i = (me + k) % n;
    xd::OutFrame f;
    f.data = send + i * block;
    f.size = block;
    sends.push_back(t->send(i, tag, {f}));
  }
  p.send_handoff = now();
  double copy = 0;
  for (int k = 0; k < n; ++k) {
    const int i = (me - k + n) % n;
    auto m = slots[i]->wait(std::chrono::seconds(120));
    die_if(m.status(), "phases recv");
    if (k == 1) p.first_block = now();  // k == 0 is our own block
    const double c0 = now();
    std::memcpy(recv + i * block, m->tensor_data(0), m->tensor_size(0));
    copy += now() - c0;
  }
  p.all_blocks = now();
  p.memcpy_s = copy;
  for (auto& c : sends) die_if(c->wait(std::chrono::seconds(120)), "phases send");
  p.sends_done = now();
  return p;
}

// Prototypes of all_to_allv built from the public Transport API, to measure
// proposed fixes to Communicator::all_to_allv_now without editing it:
//   kProtoSame   the same algorithm as communicator.cc (own block sent to self
//                through Transport::send, blocks awaited in a fixed order)
//   kSelfCopy    own block memcpy'd straight from send to recv
//   kAnyOrder    kSelfCopy + blocks copied out in arrival order (wait-any)
//   kNoCopyOut   kSelfCopy, blocks left in ZeroMQ's buffers (a zero-copy
//                receive API: the caller reads the IncomingMessages in place)
enum Variant { kReal, kProtoSame, kSelfCopy, kAnyOrder, kNoCopyOut, kNumVariants };
const char* kVariantNames[] = {"communicator (real)", "prototype, same algorithm", "+ own block by memcpy",
                               "+ copy in arrival order", "+ no copy out (zero-copy)"};

void a2a_variant(Variant v, xd::Transport* t, int me, int n, uint32_t step, const uint8_t* send, size_t block,
                 uint8_t* recv) {
  const xd::Tag tag{xd::MessageKind::kAllToAll, step, 9, static_cast<uint16_t>(v), 0};
  const bool self_copy = v != kProtoSame;
  std::vector<std::shared_ptr<xd::RecvSlot>> slots(n);
  for (int i = 0; i < n; ++i)
    if (!(self_copy && i == me)) slots[i] = t->recv(i, tag);
  std::vector<std::shared_ptr<xd::Completion>> sends;
  for (int k = self_copy ? 1 : 0; k < n; ++k) {
    const int i = (me + k) % n;
    xd::OutFrame f;
    f.data = send + i * block;
    f.size = block;
    sends.push_back(t->send(i, tag, {f}));
  }
  if (self_copy) std::memcpy(recv + me * block, send + me * block, block);
  std::vector<xd::IncomingMessage> held;  // kNoCopyOut: kept until the end
  if (v == kAnyOrder) {
    int left = n - 1;
    while (left > 0) {
      bool got = false;
      for (int i = 0; i < n; ++i) {
        if (!slots[i] || !slots[i]->ready()) continue;
        auto m = slots[i]->wait(std::chrono::seconds(1));
        die_if(m.status(), "variant recv");
        std::memcpy(recv + i * block, m->tensor_data(0), m->tensor_size(0));
        slots[i].reset();
        --left;
        got = true;
      }
      if (!got) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  } else {
    for (int k = 0; k < n; ++k) {
      const int i = (me - k + n) % n;
      if (!slots[i]) continue;
      auto m = slots[i]->wait(std::chrono::seconds(120));
      die_if(m.status(), "variant recv");
      if (v == kNoCopyOut) held.push_back(std::move(*m));
      else std::memcpy(recv + i * block, m->tensor_data(0), m->tensor_size(0));
    }
  }
  for (auto& c : sends) die_if(c->wait(std::chrono::seconds(120)), "variant send");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.malloc_tune) {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    mallopt(M_TOP_PAD, 64 << 20);
  }
  xd::TransportOptions topts;
  topts.rank = o.rank;
  topts.job = 4242;
  topts.socket_buffer_bytes = o.socket_buffer_kb * 1024;
  topts.local_send_buffer_bytes = o.local_sndbuf_kb * 1024;
  topts.io_threads = o.io_threads;
  // The largest all_gather holds world * S bytes of unmatched messages at worst.
  const size_t max_s = size_t(*std::max_element(o.sizes_mb.begin(), o.sizes_mb.end())) << 20;
  topts.recv_queue_bytes = std::max(topts.recv_queue_bytes, max_s * o.world * 2);
  auto transport = xd::Transport::create(topts);
  die_if(transport ? xd::Status::ok() : transport.status(), "creating transport");
  auto eps = xd::testing::rendezvous(o.dir, o.rank, o.world, (*transport)->endpoint(), std::chrono::seconds(120));
  die_if(eps ? xd::Status::ok() : eps.status(), "rendezvous");
  std::vector<xd::PeerInfo> peers;
  for (int r = 0; r < o.world; ++r) peers.push_back({r, (*eps)[r], 0});
  die_if((*transport)->connect(peers), "connect");
  std::vector<int> all(o.world);
  for (int r = 0; r < o.world; ++r) all[r] = r;
  xd::Communicator comm(transport->get(), all, std::chrono::seconds(300));
  Bench b{o, transport->get(), &comm};
  b.barrier();

  const int n = o.world, me = o.rank;
  struct Row { std::string op; int mb; double med, min; std::vector<double> samples; };
  std::vector<Row> rows;
  for (int mb : o.sizes_mb) {
    const size_t S = size_t(mb) << 20;
    for (const std::string& op : o.ops) {
      std::vector<uint8_t> send, recv;
      std::vector<float> data;
      std::vector<size_t> blocks(n, S / n);
      // Kept from one iteration to the next, as a caller would reuse it; the
      // next collective releases the previous one's messages.
      xd::ReceivedBlocks received;
      const bool a2a = op == "all_to_allv" || op == "all_to_allv_inplace";
      if (a2a) {
        if (S % n) usage("S must divide by world");
        send.resize(S);
        if (op == "all_to_allv") recv.assign(S, 0);
        for (int j = 0; j < n; ++j) std::memset(send.data() + j * (S / n), a2a_byte(me, j), S / n);
      } else if (op == "all_gather") {
        send.assign(S, static_cast<uint8_t>(me + 1));
        recv.assign(S * n, 0);
      } else {
        data.assign(S / sizeof(float), 0.0f);
      }
      auto run_once = [&]() {
        xd::Status st;
        if (op == "all_to_allv") st = comm.all_to_allv(b.next_tag(), send.data(), blocks, recv.data(), blocks).wait();
        else if (op == "all_to_allv_inplace") st = comm.all_to_allv(b.next_tag(), send.data(), blocks, &received).wait();
        else if (op == "all_gather") st = comm.all_gather(b.next_tag(), send.data(), S, recv.data()).wait();
        else st = comm.all_reduce(b.next_tag(), data.data(), data.size()).wait();
        die_if(st, op.c_str());
      };
      for (int w = 0; w < o.warmup; ++w) {
        b.barrier();
        run_once();
      }
      // Sanity check of the results (once, not timed).
      if (o.warmup > 0) {
        bool ok = true;
        if (op == "all_to_allv") {
          for (int i = 0; i < n; ++i)
            ok &= recv[i * (S / n)] == a2a_byte(i, me) && recv[(i + 1) * (S / n) - 1] == a2a_byte(i, me);
        } else if (op == "all_to_allv_inplace") {
          // Every byte: the blocks are read where they landed.
          ok &= received.size() == n;
          for (int i = 0; ok && i < n; ++i) {
            ok &= received.bytes(i) == S / n;
            for (size_t k = 0; ok && k < S / n; ++k) ok &= received.data(i)[k] == a2a_byte(i, me);
          }
        } else if (op == "all_gather") {
          for (int i = 0; i < n; ++i) ok &= recv[i * S] == i + 1 && recv[(i + 1) * S - 1] == i + 1;
        }
        if (!ok) { std::fprintf(stderr, "collective_bench: %s gave wrong data\n", op.c_str()); return 1; }
      }
      std::vector<double> samples;
      for (int it = 0; it < o.iters; ++it) {
        b.barrier();
        const auto t0 = Clock::now();
        run_once();
        samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      const std::vector<double> iter_max = b.max_over_ranks(samples);
      rows.push_back({op, mb, median(iter_max), *std::min_element(iter_max.begin(), iter_max.end()), iter_max});
      if (me == 0) {
        std::fprintf(stderr, "  [%s n=%d] %-19s %3d MB: median %.4f s (samples:", o.impl.c_str(), n, op.c_str(), mb,
                     rows.back().med);
        for (double s : iter_max) std::fprintf(stderr, " %.4f", s);
        std::fprintf(stderr, ")\n");
      }
    }
    if (o.variants && S % n == 0) {
      std::vector<uint8_t> send(S, 1), recv(S, 0);
      std::vector<size_t> blocks(n, S / n);
      std::vector<std::vector<double>> samples(kNumVariants);
      for (int it = 0; it < o.warmup + o.iters; ++it)
        for (int k = 0; k < kNumVariants; ++k) {
          const Variant v = static_cast<Variant>((k + it) % kNumVariants);  // rotate the order
          b.barrier();
          const auto t0 = Clock::now();
          if (v == kReal)
            die_if(comm.all_to_allv(b.next_tag(), send.data(), blocks, recv.data(), blocks).wait(), "a2a");
          else
            a2a_variant(v, b.transport, me, n, b.step++, send.data(), S / n, recv.data());
          if (it >= o.warmup) samples[v].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
      if (me == 0)
        std::printf("all_to_allv variants, %d MB/rank, world %d, median of %d interleaved iterations:\n", mb, n,
                    o.iters);
      for (int v = 0; v < kNumVariants; ++v) {
        const double med = median(b.max_over_ranks(samples[v]));
        if (me == 0) std::printf("  %-28s %9.5f s  %8.1f MB/s\n", kVariantNames[v], med, mb / med);
      }
      std::fflush(stdout);
    }
    if (o.phases && S % n == 0) {
      // Where the all_to_allv time goes on each rank (rank 0 prints the max).
      std::vector<uint8_t> send(S), recv(S);
      std::vector<A2aPhases> ps;
      for (int it = 0; it < std::max(3, o.iters); ++it) {
        b.barrier();
        ps.push_back(a2a_with_phases(b.transport, me, n, 1000000 + b.step++, send.data(), S / n, recv.data()));
      }
      std::sort(ps.begin(), ps.end(), [](const A2aPhases& a, const A2aPhases& c) { return a.sends_done < c.sends_done; });
      const A2aPhases& p = ps[ps.size() / 2];
      std::vector<double> mine = {p.send_handoff, p.first_block, p.all_blocks, p.memcpy_s, p.sends_done};
      std::vector<double> allp(mine.size() * n);
      die_if(comm.all_gather(b.next_tag(), mine.data(), mine.size() * sizeof(double), allp.data()).wait(), "phases");
      if (me == 0) {
        std::printf("a2a phases, %d MB/rank, world %d (per rank, median iteration; seconds since start):\n", mb, n);
        std::printf("  rank  send_handoff  first_peer_block  all_blocks  memcpy_total  sends_done\n");
        for (int r = 0; r < n; ++r)
          std::printf("  %4d  %12.4f  %16.4f  %10.4f  %12.4f  %10.4f\n", r, allp[r * 5], allp[r * 5 + 1],
                      allp[r * 5 + 2], allp[r * 5 + 3], allp[r * 5 + 4]);
      }
    }
  }
  b.barrier();

  if (me == 0) {
    std::printf("collective_bench (%s): world %d, %d timed iterations (+%d warm-up), loopback TCP\n",
                o.impl.c_str(), n, o.iters, o.warmup);
    std::printf("%-19s %6s %12s %12s %14s\n", "op", "MB/rank", "median s", "min s", "algbw MB/s");
    for (const Row& r : rows)
      std::printf("%-19s %6d %12.5f %12.5f %14.1f\n", r.op.c_str(), r.mb, r.med, r.min, r.mb / r.med);
    if (!o.csv.empty()) {
      std::ofstream out(o.csv, std::ios::app);
      for (const Row& r : rows)
        out << o.impl << ',' << r.op << ',' << n << ',' << r.mb << ',' << r.med << ',' << r.mb / r.med << ','
            << r.min << ',' << o.iters << '\n';
    }
    if (!o.samples.empty()) {
      std::ofstream out(o.samples, std::ios::app);
      out.precision(9);
      for (const Row& r : rows)
        for (double x : r.samples) out << o.impl << ',' << r.op << ',' << n << ',' << r.mb << ',' << x << '\n';
    }
  }
  return 0;
}
