// Goodput between two processes over the real data path (Transport, ZeroMQ,
// TCP): rank 0 sends `--megabytes` in 256 KB messages to rank 1, which prints
// the rate at which they arrived, from the first message to the last (the
// first one's bytes excluded, so connection set-up does not count). For the
// network-namespace tests: each rank runs in its own namespace.
//
// usage: xdmoe_goodput_check --rank 0|1 --rendezvous DIR --bind-host ADDR [--megabytes M]
// prints (rank 1): goodput_bits_per_s=<rate> bytes=<n> seconds=<t>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/clock.h"
#include "rendezvous.h"
#include "transport/transport.h"

int main(int argc, char** argv) {
  int rank = -1;
  std::string dir, host = "127.0.0.1";
  double megabytes = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank") rank = std::atoi(v.c_str());
    else if (k == "--rendezvous") dir = v;
    else if (k == "--bind-host") host = v;
    else if (k == "--megabytes") megabytes = std::atof(v.c_str());
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  if ((rank != 0 && rank != 1) || dir.empty() || !(megabytes > 0)) {
    std::fprintf(stderr, "usage: %s --rank 0|1 --rendezvous DIR --bind-host ADDR [--megabytes M]\n", argv[0]);
    return 2;
  }
  xd::TransportOptions opts;
  opts.rank = rank;
  opts.job = 9;
  opts.bind_endpoint = "tcp://" + host + ":*";
  auto transport = xd::Transport::create(opts);
  if (!transport) { std::fprintf(stderr, "%s\n", transport.status().to_string().c_str()); return 1; }
  auto eps = xd::testing::rendezvous(dir, rank, 2, (*transport)->endpoint(), std::chrono::seconds(60));
  if (!eps) { std::fprintf(stderr, "%s\n", eps.status().to_string().c_str()); return 1; }
  if (auto st = (*transport)->connect({{0, (*eps)[0], 0}, {1, (*eps)[1], 0}}); !st.is_ok()) {
    std::fprintf(stderr, "%s\n", st.to_string().c_str());
    return 1;
  }
  constexpr size_t kMessage = 256 << 10;
  const int messages = std::max(2, static_cast<int>(megabytes * 1e6 / kMessage));
  const xd::Tag done_tag{xd::MessageKind::kPointToPoint, 1, xd::kNoLayer, 1, 0};
  if (rank == 0) {
    std::vector<char> data(kMessage, 'x');
    for (int m = 0; m < messages; ++m)
      (*transport)->send(1, {xd::MessageKind::kPointToPoint, 0, xd::kNoLayer, 0, static_cast<uint32_t>(m)},
                         {xd::OutFrame::copy_of(data.data(), data.size())});
    auto ack = (*transport)->recv(1, done_tag)->wait(std::chrono::seconds(300));  // rank 1 has everything
    if (!ack) { std::fprintf(stderr, "%s\n", ack.status().to_string().c_str()); return 1; }
    return 0;
  }
  std::vector<std::shared_ptr<xd::RecvSlot>> slots;
  for (int m = 0; m < messages; ++m)
    slots.push_back((*transport)->recv(0, {xd::MessageKind::kPointToPoint, 0, xd::kNoLayer, 0, static_cast<uint32_t>(m)}));
  double first = 0;
  size_t bytes = 0;
  for (int m = 0; m < messages; ++m) {
    auto msg = slots[m]->wait(std::chrono::seconds(300));
    if (!msg) { std::fprintf(stderr, "%s\n", msg.status().to_string().c_str()); return 1; }
    if (m == 0) first = xd::steady_seconds();
    else bytes += msg->payload_bytes();
  }
  const double seconds = xd::steady_seconds() - first;
  (*transport)->send(0, done_tag, {});
  std::printf("goodput_bits_per_s=%.0f bytes=%zu seconds=%.3f\n", bytes * 8 / seconds, bytes, seconds);
  return 0;
}
