// goodput_bench: how close a shaped link gets to its configured rate.
//
// Two Transports in this process talk over loopback TCP. The sender's link
// class 0 (the class of its only peer) is shaped with Transport::set_shaping
// to a bandwidth and a one-way latency (transport/link_shaping.h); the sender
// streams `--total-mb` MB as `--msg-kb` KiB messages, the receiver posts all the
// receives up front. "both ways" rows shape both Transports alike and stream in
// both directions at once (the slower direction is reported). Shaping charges header + metadata bytes too, so payload
// goodput can at most reach rate * payload / (payload + 40-odd bytes).
//
//   end-to-end goodput = payload bytes / (last message received - first send)
//   steady goodput     = (payload bytes - first message) /
//                        (last message received - first message received)
// The end-to-end figure includes the one-way latency and the first message's
// transmission time once; the steady figure is the sustained rate.
// % of rate = goodput / configured bandwidth. Target: end-to-end >= 90 %.
// MB = 10^6 bytes here, so 100 Mbit/s = 12.5 MB/s exactly.
//
// usage: goodput_bench [--total-mb 60] [--msg-kb 1024] [--reps 1] [--csv FILE] [--curve]
// --curve: both links CURVE-encrypted and authenticated (transport/security.h),
// to compare with the plaintext rows of a run without it.
// Rows: unshaped loopback (reference), 100 Mbit/s, 100 Mbit/s + 5 ms,
// 1 Gbit/s, 1 Gbit/s + 5 ms, 100 Mbit/s with 64 KiB messages, and two
// "both ways" rows. The loopback wire itself is far faster than the shaped
// rates, so this measures how exactly the shaper paces, not a real network.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/security.h"
#include "transport/transport.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  double total_mb = 60;
  int msg_kb = 1024;
  int reps = 1;
  std::string csv;
  bool curve = false;
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr, "goodput_bench: %s\nusage: goodput_bench [--total-mb 60] [--msg-kb 1024] [--reps 1] [--csv FILE]\n",
               msg.c_str());
  std::exit(2);
}

void die_if(const xd::Status& st, const char* what) {
  if (st.is_ok()) return;
  std::fprintf(stderr, "goodput_bench: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}

struct Result {
  double elapsed = 0, steady = 0;  // seconds
  size_t bytes = 0, first_bytes = 0;
};

// tx streams to rx over tx's link class 0 (its only peer).
Result stream(xd::Transport* tx, xd::Transport* rx, uint32_t step, size_t total, size_t msg,
              const std::vector<uint8_t>& buf) {
  const int src = tx->rank(), dst = rx->rank();
  const size_t count = (total + msg - 1) / msg;
  std::vector<std::shared_ptr<xd::RecvSlot>> slots(count);
  for (size_t i = 0; i < count; ++i)
    slots[i] = rx->recv(src, xd::Tag{xd::MessageKind::kPointToPoint, step, 0, 0, static_cast<uint32_t>(i)});
  std::vector<std::shared_ptr<xd::Completion>> sends;
  Result r;
  const auto t0 = Clock::now();
  Clock::time_point first_recv;
  // Send from a separate thread so that backpressure (send() blocking on the
  // per-link byte bound) never stops us from draining receives.
  std::thread sender([&] {
    for (size_t i = 0; i < count; ++i) {
      const size_t n = std::min(msg, total - i * msg);
      xd::OutFrame f;
      f.data = buf.data();
      f.size = n;
      sends.push_back(tx->send(dst, xd::Tag{xd::MessageKind::kPointToPoint, step, 0, 0, static_cast<uint32_t>(i)}, {f}));
    }
  });
  for (size_t i = 0; i < count; ++i) {
    auto m = slots[i]->wait(std::chrono::seconds(600));
    die_if(m.status(), "receive");
    if (i == 0) {
      first_recv = Clock::now();
      r.first_bytes = m->payload_bytes();
    }
    r.bytes += m->payload_bytes();
  }
  const auto t1 = Clock::now();
  sender.join();
  for (auto& c : sends) die_if(c->wait(std::chrono::seconds(60)), "send");
  r.elapsed = std::chrono::duration<double>(t1 - t0).count();
  r.steady = std::chrono::duration<double>(t1 - first_recv).count();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") usage("help");
    if (k == "--curve") {
      o.curve = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + k);
    const std::string v = argv[++i];
    if (k == "--total-mb") o.total_mb = std::atof(v.c_str());
    else if (k == "--msg-kb") o.msg_kb = std::atoi(v.c_str());
    else if (k == "--reps") o.reps = std::atoi(v.c_str());
    else if (k == "--csv") o.csv = v;
    else usage("unknown option " + k);
  }
  if (o.total_mb <= 0 || o.msg_kb <= 0 || o.reps <= 0) usage("values must be positive");

  xd::TransportOptions a, b;
  a.rank = 0;
  b.rank = 1;
  a.job = b.job = 77;
  a.link_class_names = b.link_class_names = {"shaped"};
  xd::CurveKeys ka, kb;
  if (o.curve) {
    auto x = xd::generate_curve_keys(), y = xd::generate_curve_keys();
    die_if(x ? xd::Status::ok() : x.status(), "keys");
    ka = *x;
    kb = *y;
    a.security = {true, ka, "", xd::kZapDomainData};
    b.security = {true, kb, "", xd::kZapDomainData};
    xd::set_allowed_keys(xd::kZapDomainData, {ka.public_key, kb.public_key});
  }
  auto ta = xd::Transport::create(a);
  auto tb = xd::Transport::create(b);
  die_if(ta ? xd::Status::ok() : ta.status(), "transport 0");
  die_if(tb ? xd::Status::ok() : tb.status(), "transport 1");
  const std::vector<xd::PeerInfo> peers = {{0, (*ta)->endpoint(), 0, ka.public_key},
                                           {1, (*tb)->endpoint(), 0, kb.public_key}};
  die_if((*ta)->connect(peers), "connect 0");
  die_if((*tb)->connect(peers), "connect 1");

  struct Case {
    const char* name;
    double bw;       // bytes/s, 0 = unshaped
    double latency;  // s
    size_t msg;      // bytes
    bool both_ways = false;  // stream 1 -> 0 at the same time, same shaping; report the slower direction
  };
  const size_t msg = size_t(o.msg_kb) << 10;
  const std::vector<Case> cases = {
      {"unshaped loopback", 0, 0, msg},
      {"100 Mbit/s", 12.5e6, 0, msg},
      {"100 Mbit/s + 5 ms", 12.5e6, 0.005, msg},
      {"1 Gbit/s", 125e6, 0, msg},
      {"1 Gbit/s + 5 ms", 125e6, 0.005, msg},
      {"100 Mbit/s, 64 KiB msgs", 12.5e6, 0, size_t(64) << 10},
      {"100 Mbit/s, both ways", 12.5e6, 0, msg, true},
      {"1 Gbit/s + 5 ms, both ways", 125e6, 0.005, msg, true},
  };
  const size_t total = static_cast<size_t>(o.total_mb * 1e6);
  std::vector<uint8_t> buf(std::max(msg, size_t(64) << 10), 0x5A);

  // Warm the connection up (unshaped).
  (*ta)->set_shaping(0, xd::LinkShaping{});
  stream(ta->get(), tb->get(), 1, 8 << 20, msg, buf);

  std::printf("goodput_bench: %.0f MB (10^6 B) per direction over loopback TCP%s, %d rep(s), median\n",
              o.total_mb, o.curve ? ", CURVE" : ", plaintext", o.reps);
  std::printf("%-28s %9s %9s %9s %11s %12s %9s %9s\n", "link", "rate MB/s", "lat ms", "msg KiB", "elapsed s",
              "goodput MB/s", "% rate", "steady %");
  std::ofstream csv;
  if (!o.csv.empty()) {
    csv.open(o.csv);
    csv << "link,rate_MBps,latency_ms,msg_kb,total_mb,elapsed_s,goodput_MBps,pct_of_rate,steady_pct_of_rate\n";
  }
  uint32_t step = 2;
  bool all_ok = true;
  for (const Case& c : cases) {
    (*ta)->set_shaping(0, xd::LinkShaping{c.bw, c.latency});
    (*tb)->set_shaping(0, c.both_ways ? xd::LinkShaping{c.bw, c.latency} : xd::LinkShaping{});
    std::vector<Result> rs;
    for (int k = 0; k < o.reps; ++k) {
      if (!c.both_ways) {
        rs.push_back(stream(ta->get(), tb->get(), step++, total, c.msg, buf));
        continue;
      }
      Result back;
      const uint32_t s0 = step++, s1 = step++;
      std::thread rev([&] { back = stream(tb->get(), ta->get(), s1, total, c.msg, buf); });
      Result fwd = stream(ta->get(), tb->get(), s0, total, c.msg, buf);
      rev.join();
      rs.push_back(fwd.elapsed >= back.elapsed ? fwd : back);
    }
    std::sort(rs.begin(), rs.end(), [](const Result& x, const Result& y) { return x.elapsed < y.elapsed; });
    const Result& r = rs[rs.size() / 2];
    const double goodput = r.bytes / r.elapsed / 1e6;
    const double steady = (r.bytes - r.first_bytes) / r.steady / 1e6;
    const double pct = c.bw > 0 ? 100.0 * goodput * 1e6 / c.bw : 0;
    const double spct = c.bw > 0 ? 100.0 * steady * 1e6 / c.bw : 0;
    if (c.bw > 0 && pct < 90) all_ok = false;
    char rate[32], p1[32], p2[32];
    std::snprintf(rate, sizeof rate, c.bw > 0 ? "%.1f" : "-", c.bw / 1e6);
    std::snprintf(p1, sizeof p1, c.bw > 0 ? "%.1f" : "-", pct);
    std::snprintf(p2, sizeof p2, c.bw > 0 ? "%.1f" : "-", spct);
    std::printf("%-28s %9s %9.1f %9zu %11.3f %12.2f %9s %9s\n", c.name, rate, c.latency * 1e3, c.msg >> 10,
                r.elapsed, goodput, p1, p2);
    if (csv) csv << '"' << c.name << "\"," << c.bw / 1e6 << ',' << c.latency * 1e3 << ',' << (c.msg >> 10) << ','
                 << o.total_mb << ',' << r.elapsed << ',' << goodput << ',' << pct << ',' << spct << '\n';
  }
  std::printf("target (every shaped row >= 90%% of its rate, end to end): %s\n", all_ok ? "MET" : "NOT MET");
  return 0;
}
