// KernelShaper: the inter-DC `tbf` qdiscs of a network-namespace cluster made
// by scripts/netns-cluster.sh (one per worker namespace, on the egress to
// other DCs), read from its state file (/run/xdmoe-netns/cluster.json).
// set_rate() changes every one with `ip netns exec <ns> tc qdisc change`, as
// `xdmoe throttle` does in --netns mode. Needs root. Copyable; not thread-safe (the coordinator's
// control thread owns it).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace xd {

class KernelShaper {
 public:
  static Expected<KernelShaper> load(const std::string& state_path);

  // bytes/s > 0. Every worker's inter-DC tbf gets the same rate.
  Status set_rate(double bytes_per_s);

  // The tc arguments for a rate: "rate 100000000bit burst 65536 latency 100ms"
  // (the bucket holds 4 ms at the rate, at least 64 KB: the same as
  // scripts/netns-cluster.sh gives a cluster it makes).
  static std::vector<std::string> tbf_args(double bits_per_s);

 private:
  std::string state_path_, dev_, parent_, handle_;
  std::vector<std::string> namespaces_;
};

}  // namespace xd
