// G Transports in this process, connected to each other over loopback, for
// unit tests of what runs on top of them (exchanges, collectives, buckets).
#pragma once

#include <memory>
#include <vector>

#include "common/check.h"
#include "transport/transport.h"

namespace xd::testing {

inline std::vector<std::unique_ptr<Transport>> local_transports(int world) {
  std::vector<std::unique_ptr<Transport>> transports;
  for (int r = 0; r < world; ++r) {
    TransportOptions o;
    o.rank = r;
    auto t = Transport::create(o);
    XD_CHECK(t.has_value());
    transports.push_back(std::move(*t));
  }
  std::vector<PeerInfo> peers;
  for (int r = 0; r < world; ++r) peers.push_back({r, transports[r]->endpoint(), 0});
  for (auto& t : transports) XD_CHECK(t->connect(peers).is_ok());
  return transports;
}

}  // namespace xd::testing
