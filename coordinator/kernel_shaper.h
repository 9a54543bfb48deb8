// KernelShaper: the inter-DC `tbf` qdiscs of a network-namespace cluster made
// by scripts/netns-cluster.sh, read from its state file
// (/run/xdmoe-netns/cluster.json). set_rate() changes every DC's qdisc with
// `ip netns exec <router> tc qdisc change`, as `xdmoe throttle` does in
// --netns mode. Needs root. Copyable; not thread-safe (the coordinator's
// control thread owns it).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace xd {

class KernelShaper {
 public:
  static Expected<KernelShaper> load(const std::string& state_path);

  // bytes/s > 0. Every bridge gets the same rate.
  Status set_rate(double bytes_per_s);

  // The tc arguments for a rate: "rate 100000000bit burst 65536 latency 100ms"
  // (the bucket holds 4 ms at the rate, at least 64 KB).
  static std::vector<std::string> tbf_args(double bits_per_s);

  const std::string& router() const { return router_; }
  const std::vector<std::string>& bridges() const { return bridges_; }
  double rate_bytes_per_s() const { return rate_bytes_per_s_; }

 private:
  std::string state_path_, router_;
  std::vector<std::string> bridges_;
  double rate_bytes_per_s_ = 0;
};

}  // namespace xd
