// Hostfiles: the hosts of a job in the DeepSpeed / OpenMPI style, one host per
// line:
//     # comment
//     node-a slots=2 dc=east
//     node-b slots=2 dc=west
// `slots` (default 1) is the number of workers on the host; `dc` (optional,
// on every line or on none) names the host's coordinate in the outermost
// level. Without `dc`, hosts fill the ranks in file order. Plain functions.
#pragma once

#include <string>
#include <vector>

#include "cluster/cluster_spec.h"

namespace xd {

// Parses hostfile text. `source` names it in errors, which give the line:
// "hosts.txt:3: unknown key 'slot' (slots, dc)". DC names become coordinates
// 0, 1, ... in the order they first appear; without them every dc is -1.
Expected<std::vector<HostSpec>> parse_hostfile(const std::string& text, const std::string& source);
Expected<std::vector<HostSpec>> load_hostfile(const std::string& path);

// The host of every rank of a cluster whose `hosts` passed validate(): the
// ranks of coordinate d (the outermost level) are d*G/SF^0 ... and the hosts
// of dc d fill them in their order; with dc -1 the hosts fill ranks 0..G-1.
std::vector<std::string> hosts_by_rank(const ClusterSpec& cluster);

}  // namespace xd
