// Feeds arbitrary text to the hostfile parser (cluster/hostfile.h). Checks what
// parse_hostfile promises of the hosts it returns (a name that is not an
// option, slots >= 1, dc on every host or none, dc numbered 0.. in order of
// appearance), then puts them in a two-level cluster that fits their slots
// and, when ClusterSpec::validate accepts it, checks that hosts_by_rank gives
// every rank one of the hosts, in the number of slots each has.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "cluster/hostfile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace xd;
  Expected<std::vector<HostSpec>> hosts =
      parse_hostfile(std::string(reinterpret_cast<const char*>(data), size), "fuzz-hosts");
  if (!hosts) return 0;
  if (hosts->empty()) std::abort();
  const bool by_order = hosts->front().dc == -1;
  int next_dc = 0;
  long long total = 0;
  for (const HostSpec& h : *hosts) {
    if (h.host.empty() || h.host[0] == '-' || h.host.find('=') != std::string::npos) std::abort();
    if (h.slots < 1 || (h.dc == -1) != by_order || h.dc > next_dc) std::abort();
    if (h.dc == next_dc) ++next_dc;
    total += h.slots;
  }

  ClusterSpec c = default_cluster_spec();
  const int dcs = by_order ? 1 : next_dc;
  if (total % dcs != 0 || total / dcs > 65535) return 0;
  c.levels[0].size = dcs;
  c.levels[1].size = static_cast<int>(total / dcs);
  c.expert_parallel.domain_sizes = {1, 1};
  c.hosts = *hosts;
  if (!c.validate().is_ok()) return 0;
  const std::vector<std::string> by_rank = hosts_by_rank(c);
  if (static_cast<long long>(by_rank.size()) != total) std::abort();
  std::map<std::string, long long> slots, seen;
  for (const HostSpec& h : *hosts) slots[h.host] += h.slots;
  for (const std::string& host : by_rank) ++seen[host];
  if (seen != slots) std::abort();
  return 0;
}
