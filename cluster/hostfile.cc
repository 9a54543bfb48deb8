#include "cluster/hostfile.h"

#include <fstream>
#include <map>
#include <sstream>

namespace xd {

Expected<std::vector<HostSpec>> parse_hostfile(const std::string& text, const std::string& source) {
  std::vector<HostSpec> hosts;
  std::map<std::string, int> dc_index;
  std::istringstream lines(text);
  std::string line;
  int line_no = 0, with_dc = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    auto fail = [&](const std::string& what) {
      return Status::invalid_argument(source + ":" + std::to_string(line_no) + ": " + what);
    };
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;  // blank or comment
    if (host.find('=') != std::string::npos) return fail("the line must start with a host name, not '" + host + "'");
    if (host[0] == '-') return fail("a host name cannot start with '-' ('" + host + "')");
    HostSpec h;
    h.host = host;
    h.dc = -1;
    bool have_slots = false, have_dc = false;
    while (words >> word) {
      const size_t eq = word.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == word.size())
        return fail("expected key=value after the host, got '" + word + "'");
      const std::string key = word.substr(0, eq), value = word.substr(eq + 1);
      if (key == "slots" || key == "max_slots" || key == "max-slots") {
        if (key != "slots") continue;  // OpenMPI's cap; the slots are what we run
        if (have_slots) return fail("slots given twice");
        if (value.find_first_not_of("0123456789") != std::string::npos || value.size() > 6)
          return fail("slots must be a positive integer, got '" + value + "'");
        h.slots = std::stoi(value);
        if (h.slots < 1) return fail("slots must be at least 1");
        have_slots = true;
      } else if (key == "dc") {
        if (have_dc) return fail("dc given twice");
        auto [it, inserted] = dc_index.emplace(value, static_cast<int>(dc_index.size()));
        h.dc = it->second;
        have_dc = true;
      } else {
        return fail("unknown key '" + key + "' (slots, dc)");
      }
    }
    if (have_dc) ++with_dc;
    if (with_dc != 0 && with_dc != static_cast<int>(hosts.size()) + 1)
      return fail("dc= must be on every line or on none (host '" + host + "')");
    hosts.push_back(h);
  }
  if (hosts.empty()) return Status::invalid_argument(source + ": no hosts");
  return hosts;
}

Expected<std::vector<HostSpec>> load_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::not_found("cannot read hostfile " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hostfile(ss.str(), path);
}

std::vector<std::string> hosts_by_rank(const ClusterSpec& cluster) {
  const int g = cluster.world_size();
  std::vector<std::string> by_rank;
  if (cluster.hosts.empty()) return by_rank;
  by_rank.reserve(g);
  if (cluster.hosts.front().dc < 0) {
    for (const HostSpec& h : cluster.hosts)
      for (int s = 0; s < h.slots && static_cast<int>(by_rank.size()) < g; ++s) by_rank.push_back(h.host);
    return by_rank;
  }
  for (int d = 0; d < cluster.levels[0].size; ++d)
    for (const HostSpec& h : cluster.hosts)
      if (h.dc == d)
        for (int s = 0; s < h.slots; ++s) by_rank.push_back(h.host);
  return by_rank;
}

}  // namespace xd
