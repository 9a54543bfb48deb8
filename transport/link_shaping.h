// LinkShaping: the in-process emulation of one link class (netem is
// unavailable). A worker's egress on a link class is one zero-burst token
// bucket shared by all its peers of that class, paced at
// `bandwidth_bytes_per_s` (oldest message first across those peers), and every
// message is held back a further `latency_s` (one-way latency) while the next
// one already transmits. Plain data. Unit parsers: common/units.h.
#pragma once

namespace xd {

struct LinkShaping {
  double bandwidth_bytes_per_s = 0;  // 0: unlimited
  double latency_s = 0;
  // A link whose bandwidth something else shapes (the kernel's tbf in a
  // namespace cluster): not paced here, but its transmit time is counted at
  // this rate, so that the step's bound still sees the link. 0: not counted.
  double accounted_bytes_per_s = 0;
  bool shaped() const { return bandwidth_bytes_per_s > 0 || latency_s > 0; }
};

}  // namespace xd
