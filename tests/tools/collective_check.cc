// One process of a multi-process collectives check. Every rank derives every
// other rank's data from the seed, so each can compute the exact expected
// result locally. Values are small integers stored as floats, so sums are exact
// in any order and results compare element by element.
//
// usage: xdmoe_collective_check --rank R --world N --rendezvous DIR
//                               [--seed S] [--rounds K] [--inner M]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/rng.h"
#include "rendezvous.h"
#include "transport/communicator.h"

namespace {

using xd::CollectiveTag;
using xd::Communicator;
using xd::splitmix64;

int g_checks = 0, g_failures = 0;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    if (g_failures <= 20) std::fprintf(stderr, "MISMATCH: %s\n", what.c_str());
  }
}

void check_status(const xd::Status& st, const std::string& what) {
  check(st.is_ok(), what + ": " + st.to_string());
}

// Agreed-upon random numbers: the same on every rank for the same key.
uint64_t agreed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  return splitmix64(splitmix64(splitmix64(seed ^ a) ^ b) ^ c);
}

// A block size that is zero about a quarter of the time.
size_t block_size(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, size_t max) {
  const uint64_t r = agreed(seed, a, b, c);
  return (r & 3) == 0 ? 0 : (r >> 8) % max;
}

float value(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return static_cast<float>(static_cast<int>(agreed(seed, a, b, c) % 201) - 100);
}

// One all_to_allv pattern: block sizes (a quarter of them zero) and contents
// that every rank can derive for any pair of members.
struct AllToAllPattern {
  uint64_t seed;
  uint32_t step;
  uint64_t variant;
  int silent = -1;  // a member with nothing to send, or none
  int deaf = -1;    // a member with nothing to receive, or none
  size_t bytes(int from, int to) const {
    if (from == silent || to == deaf) return 0;
    return block_size(seed, 1 + 16 * variant, from * 64 + to, step, 3000);
  }
  uint8_t byte_at(int from, int to, size_t k) const {
    return static_cast<uint8_t>(agreed(seed ^ variant, from, to, k ^ (uint64_t(step) << 40)));
  }
  // This member's send buffer and the sizes it sends and receives.
  void fill(int n, int me, std::vector<uint8_t>* send, std::vector<size_t>* send_bytes,
            std::vector<size_t>* recv_bytes) const {
    send->clear();
    send_bytes->assign(n, 0);
    recv_bytes->assign(n, 0);
    for (int j = 0; j < n; ++j) {
      (*send_bytes)[j] = bytes(me, j);
      (*recv_bytes)[j] = bytes(j, me);
      for (size_t k = 0; k < (*send_bytes)[j]; ++k) send->push_back(byte_at(me, j, k));
    }
  }
};

// Compares every byte of every block of a zero-copy all_to_allv with the
// pattern; the own block must be the caller's send buffer, not a copy.
void check_received_blocks(const xd::ReceivedBlocks& got, const AllToAllPattern& pattern, int n, int me,
                           const std::vector<uint8_t>& send, const std::vector<size_t>& send_bytes,
                           const std::string& label) {
  check(got.size() == n, label + " has " + std::to_string(got.size()) + " blocks, expected " + std::to_string(n));
  if (got.size() != n) return;
  for (int j = 0; j < n; ++j) {
    const size_t expect = pattern.bytes(j, me);
    bool ok = got.bytes(j) == expect && (expect == 0 || got.data(j) != nullptr);
    for (size_t k = 0; ok && k < expect; ++k) ok = got.data(j)[k] == pattern.byte_at(j, me, k);
    check(ok, label + " block from " + std::to_string(j) + " (" + std::to_string(got.bytes(j)) + " bytes, expected " +
                  std::to_string(expect) + ")");
  }
  size_t own_offset = 0;
  for (int j = 0; j < me; ++j) own_offset += send_bytes[j];
  check(send_bytes[me] == 0 || got.data(me) == send.data() + own_offset, label + " own block points into send");
}

void check_all_to_allv(Communicator& comm, uint64_t seed, uint32_t step, const std::string& label) {
  const int n = comm.size(), me = comm.index();
  const AllToAllPattern pattern{seed, step, 0};
  std::vector<size_t> send_bytes, recv_bytes;
  std::vector<uint8_t> send;
  pattern.fill(n, me, &send, &send_bytes, &recv_bytes);

  // Zero-copy first, read last: its blocks must stay intact while the other
  // forms below receive (and free) messages through the same transport. Its
  // own pattern, so that a block whose memory was handed back and refilled by
  // a later message shows up as a mismatch.
  const AllToAllPattern zero_copy{seed, step, 2};
  std::vector<size_t> zero_copy_send_bytes, zero_copy_recv_bytes;
  std::vector<uint8_t> zero_copy_send;
  zero_copy.fill(n, me, &zero_copy_send, &zero_copy_send_bytes, &zero_copy_recv_bytes);
  xd::ReceivedBlocks in_place;
  check_status(comm.all_to_allv({step, 0, 3}, zero_copy_send.data(), zero_copy_send_bytes, &in_place).wait(),
               label + " all_to_allv(in place)");

  size_t total = 0;
  for (size_t b : recv_bytes) total += b;
  std::vector<uint8_t> recv(total, 0xAB);
  check_status(comm.all_to_allv({step, 0, 0}, send.data(), send_bytes, recv.data(), recv_bytes).wait(),
               label + " all_to_allv");
  size_t off = 0;
  bool contents_ok = true;
  for (int j = 0; j < n && contents_ok; ++j)
    for (size_t k = 0; k < recv_bytes[j]; ++k, ++off)
      if (recv[off] != pattern.byte_at(j, me, k)) {
        check(false, label + " all_to_allv byte from " + std::to_string(j));
        contents_ok = false;
        break;
      }
  check(contents_ok, label + " all_to_allv contents");
  // Sizes not known in advance.
  std::vector<std::vector<uint8_t>> blocks;
  check_status(comm.all_to_allv({step, 0, 1}, send.data(), send_bytes, &blocks).wait(),
               label + " all_to_allv(discover)");
  for (int j = 0; j < n; ++j) {
    bool ok = blocks.size() == (size_t)n && blocks[j].size() == recv_bytes[j];
    for (size_t k = 0; ok && k < recv_bytes[j]; ++k) ok = blocks[j][k] == pattern.byte_at(j, me, k);
    check(ok, label + " all_to_allv(discover) block from " + std::to_string(j));
  }
  check_received_blocks(in_place, zero_copy, n, me, zero_copy_send, zero_copy_send_bytes,
                        label + " all_to_allv(in place)");

  // The same object refilled by a collective with other sizes and contents,
  // where one member sends nothing and another receives nothing.
  const AllToAllPattern other{seed, step, 1, static_cast<int>(step % n), static_cast<int>((step + 1) % n)};
  std::vector<size_t> other_send_bytes, other_recv_bytes;
  std::vector<uint8_t> other_send;
  other.fill(n, me, &other_send, &other_send_bytes, &other_recv_bytes);
  check_status(comm.all_to_allv({step, 0, 4}, other_send.data(), other_send_bytes, &in_place).wait(),
               label + " all_to_allv(in place, refilled)");
  check_received_blocks(in_place, other, n, me, other_send, other_send_bytes,
                        label + " all_to_allv(in place, refilled)");
}

void check_all_gatherv(Communicator& comm, uint64_t seed, uint32_t step, const std::string& label) {
  const int n = comm.size(), me = comm.index();
  std::vector<size_t> bytes(n);
  size_t total = 0;
  for (int i = 0; i < n; ++i) total += bytes[i] = block_size(seed, 2, i, step, 5000) * 4;
  std::vector<float> mine(bytes[me] / 4);
  for (size_t k = 0; k < mine.size(); ++k) mine[k] = value(seed, 3, me, k + step * 100000ull);
  std::vector<float> out(total / 4, -999.f);
  check_status(comm.all_gatherv({step, 0, 2}, mine.data(), out.data(), bytes).wait(), label + " all_gatherv");
  size_t off = 0;
  bool ok = true;
  for (int i = 0; i < n; ++i)
    for (size_t k = 0; k < bytes[i] / 4; ++k, ++off) ok &= out[off] == value(seed, 3, i, k + step * 100000ull);
  check(ok, label + " all_gatherv contents");
}

std::vector<float> contribution(uint64_t seed, int member, size_t count, uint32_t step, uint64_t what) {
  std::vector<float> v(count);
  for (size_t k = 0; k < count; ++k) v[k] = value(seed, what, member, k + step * 1000000ull);
  return v;
}

void check_reductions(Communicator& comm, uint64_t seed, uint32_t step, const std::string& label) {
  const int n = comm.size(), me = comm.index();
  // all_reduce: counts include 0 and counts smaller than the group.
  const size_t sizes[] = {0, 1, (size_t)n - 1, 1000 + agreed(seed, 4, step) % 50000};
  uint16_t phase = 10;
  for (size_t count : sizes) {
    std::vector<float> data = contribution(seed, me, count, step, 5);
    check_status(comm.all_reduce({step, 0, phase++}, data.data(), count).wait(), label + " all_reduce");
    bool ok = true;
    for (size_t k = 0; k < count; ++k) {
      float expect = 0;
      for (int i = 0; i < n; ++i) expect += value(seed, 5, i, k + step * 1000000ull);
      ok &= data[k] == expect;
    }
    check(ok, label + " all_reduce of " + std::to_string(count));
  }
  // reduce_scatter with uneven and empty blocks.
  std::vector<size_t> counts(n);
  size_t total = 0;
  for (int i = 0; i < n; ++i) total += counts[i] = block_size(seed, 6, i, step, 4000);
  std::vector<float> data = contribution(seed, me, total, step, 7), out(counts[me], -1.f);
  check_status(comm.reduce_scatter({step, 0, 20}, data.data(), counts, out.data()).wait(),
               label + " reduce_scatter");
  size_t off = 0;
  for (int i = 0; i < me; ++i) off += counts[i];
  bool ok = true;
  for (size_t k = 0; k < counts[me]; ++k) {
    float expect = 0;
    for (int i = 0; i < n; ++i) expect += value(seed, 7, i, off + k + step * 1000000ull);
    ok &= out[k] == expect;
  }
  check(ok, label + " reduce_scatter contents");
}

void check_broadcast_and_barrier(Communicator& comm, uint64_t seed, uint32_t step, const std::string& label) {
  const int root = static_cast<int>(agreed(seed, 8, step) % comm.size());
  std::vector<float> data = comm.index() == root ? contribution(seed, root, 777, step, 9)
                                                 : std::vector<float>(777, 0.f);
  check_status(comm.broadcast({step, 0, 30}, data.data(), data.size() * 4, root).wait(), label + " broadcast");
  check(data == contribution(seed, root, 777, step, 9), label + " broadcast contents");
  check_status(comm.barrier({step, 0, 31}).wait(), label + " barrier");
}

// Several collectives in flight at once, awaited in a rank-dependent order.
void check_concurrent(Communicator& comm, uint64_t seed, uint32_t step) {
  const int n = comm.size(), me = comm.index();
  const size_t count = 20000;
  std::vector<std::vector<float>> data(4);
  std::vector<xd::CollectiveHandle> handles;
  for (int c = 0; c < 4; ++c) {
    data[c] = contribution(seed, me, count, step, 40 + c);
    handles.push_back(comm.all_reduce({step, 7, (uint16_t)(100 + c)}, data[c].data(), count));
  }
  for (int k = 0; k < 4; ++k) {
    const int c = (me % 2) ? 3 - k : k;
    check_status(handles[c].wait(), "concurrent all_reduce");
  }
  bool ok = true;
  for (int c = 0; c < 4; ++c)
    for (size_t k = 0; k < count; k += 97) {
      float expect = 0;
      for (int i = 0; i < n; ++i) expect += value(seed, 40 + c, i, k + step * 1000000ull);
      ok &= data[c][k] == expect;
    }
  check(ok, "concurrent all_reduce contents");
}

}  // namespace

int main(int argc, char** argv) {
  int rank = -1, world = 0, rounds = 3, inner = 0;
  uint64_t seed = 42;
  std::string dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank") rank = std::atoi(v.c_str());
    else if (k == "--world") world = std::atoi(v.c_str());
    else if (k == "--rendezvous") dir = v;
    else if (k == "--seed") seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--rounds") rounds = std::atoi(v.c_str());
    else if (k == "--inner") inner = std::atoi(v.c_str());
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  if (rank < 0 || world <= 0 || rank >= world || dir.empty()) {
    std::fprintf(stderr, "usage: %s --rank R --world N --rendezvous DIR [--seed S] [--rounds K] [--inner M]\n", argv[0]);
    return 2;
  }
  xd::TransportOptions opts;
  opts.rank = rank;
  opts.job = 7;
  auto transport = xd::Transport::create(opts);
  if (!transport) { std::fprintf(stderr, "%s\n", transport.status().to_string().c_str()); return 1; }
  auto eps = xd::testing::rendezvous(dir, rank, world, (*transport)->endpoint(), std::chrono::seconds(60));
  if (!eps) { std::fprintf(stderr, "%s\n", eps.status().to_string().c_str()); return 1; }
  std::vector<xd::PeerInfo> peers;
  for (int r = 0; r < world; ++r) peers.push_back({r, (*eps)[r], 0});
  if (auto st = (*transport)->connect(peers); !st.is_ok()) { std::fprintf(stderr, "%s\n", st.to_string().c_str()); return 1; }

  std::vector<int> all(world);
  for (int r = 0; r < world; ++r) all[r] = r;
  Communicator world_comm(transport->get(), all, std::chrono::seconds(60));
  check_status(world_comm.barrier({0, 0, 999}).wait(), "initial barrier");
  for (int round = 0; round < rounds; ++round) {
    const uint32_t step = 1000 + round;
    const std::string label = "round " + std::to_string(round);
    check_all_to_allv(world_comm, seed, step, label);
    check_all_gatherv(world_comm, seed, step, label);
    check_reductions(world_comm, seed, step, label);
    check_broadcast_and_barrier(world_comm, seed, step, label);
    check_concurrent(world_comm, seed, step);
  }
  // all_gather(v) in small chunks, and all_gather(v) and reduce_scatter as
  // rings and direct (the defaults only chunk and switch to rings at
  // megabytes), alone and inside all_reduce.
  for (const size_t ring_min : {size_t(4000), std::numeric_limits<size_t>::max()}) {
    Communicator chunked(transport->get(), all, std::chrono::seconds(60));
    chunked.set_chunking(1000, ring_min);
    const std::string label = ring_min == 4000 ? "chunked ring" : "chunked one-to-all";
    const uint32_t step = ring_min == 4000 ? 7000 : 7100;
    for (int round = 0; round < rounds; ++round) {
      check_all_gatherv(chunked, seed + 7, step + round, label);
      check_reductions(chunked, seed + 8, step + 50 + round, label);
    }
  }
  if (inner > 0 && world % inner == 0 && world > inner) {
    // Two levels (outer x inner): collectives along each level, and the
    // hierarchical all-reduce.
    const std::vector<int> levels = {world / inner, inner};
    Communicator inner_comm(transport->get(), xd::ranks_along_level(levels, 1, rank), std::chrono::seconds(60));
    Communicator outer_comm(transport->get(), xd::ranks_along_level(levels, 0, rank), std::chrono::seconds(60));
    check_all_to_allv(inner_comm, seed + 1, 5000, "inner level");
    check_all_to_allv(outer_comm, seed + 2, 5001, "outer level");
    const size_t count = 30001;
    std::vector<float> data = contribution(seed, rank, count, 6000, 50);
    check_status(xd::hierarchical_all_reduce(&inner_comm, &outer_comm, {6000, 0, 60}, data.data(), count).wait(),
                 "hierarchical all_reduce");
    bool ok = true;
    for (size_t k = 0; k < count; ++k) {
      float expect = 0;
      for (int i = 0; i < world; ++i) expect += value(seed, 50, i, k + 6000 * 1000000ull);
      ok &= data[k] == expect;
    }
    check(ok, "hierarchical all_reduce contents");
  }
  check_status(world_comm.barrier({0, 0, 998}).wait(), "final barrier");
  std::printf("collective_check rank %d/%d: %d checks, %d failures\n", rank, world, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
