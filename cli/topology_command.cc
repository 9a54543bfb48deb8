// xdmoe topology: the HybridEP pair counts (and optionally every pair) of a
// multilevel layout with given expert-domain sizes.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cluster/topology.h"

namespace xd::cli {

namespace {
struct TopologyOptions {
  std::vector<int> levels;
  std::vector<int> domains;
  bool json = false;
  bool pairs = false;
};

int run_topology(const TopologyOptions& o) {
  std::vector<int> domains = o.domains;
  if (domains.empty()) domains.assign(o.levels.size(), 1);
  auto topo = Topology::create(o.levels, domains);
  if (!topo) {
    std::fprintf(stderr, "xdmoe topology: %s\n", topo.status().message().c_str());
    return 2;
  }
  const Topology& t = *topo;
  if (o.json) {
    nlohmann::json j;
    j["levels"] = t.level_sizes();
    j["domains"] = t.domain_sizes();
    j["world_size"] = t.world_size();
    j["per_level"] = nlohmann::json::array();
    for (int l = 0; l < t.num_levels(); ++l) {
      const PairCounts c = t.pair_counts(l);
      j["per_level"].push_back({{"level", l},
                                {"size", t.level_sizes()[l]},
                                {"domain_size", t.domain_sizes()[l]},
                                {"num_domains", t.level_sizes()[l] / t.domain_sizes()[l]},
                                {"ag_pairs", c.ag},
                                {"a2a_pairs", c.a2a}});
    }
    if (o.pairs) {
      j["pairs"] = nlohmann::json::array();
      for (const TopologyPair& p : t.pairs())
        j["pairs"].push_back({{"m", p.m}, {"n", p.n}, {"level", p.level}, {"type", pair_type_name(p.type)}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("topology: %s\n", t.describe().c_str());
  std::printf("%5s %6s %6s %8s %12s %12s\n", "level", "SF", "S", "domains", "AG pairs", "A2A pairs");
  long long ag = 0, a2a = 0;
  for (int l = 0; l < t.num_levels(); ++l) {
    const PairCounts c = t.pair_counts(l);
    ag += c.ag;
    a2a += c.a2a;
    std::printf("%5d %6d %6d %8d %12lld %12lld\n", l, t.level_sizes()[l], t.domain_sizes()[l],
                t.level_sizes()[l] / t.domain_sizes()[l], c.ag, c.a2a);
  }
  std::printf("%-28s %12lld %12lld\n", "total", ag, a2a);
  std::printf("(ordered pairs: m -> n counts once, n -> m once more)\n");
  if (o.pairs) {
    std::printf("pairs (m, n, level, type):\n");
    for (const TopologyPair& p : t.pairs())
      std::printf("(%d, %d, %d, %s)\n", p.m, p.n, p.level, pair_type_name(p.type));
  }
  return 0;
}
}  // namespace

void add_topology_command(CLI::App& app, int* exit_code) {
  auto opts = std::make_shared<TopologyOptions>();
  CLI::App* cmd = app.add_subcommand(
      "topology", "Print the HybridEP AG/A2A pairs of a multilevel layout (HybridEP Alg. 1, Table VII)");
  cmd->add_option("--levels", opts->levels, "Level sizes SF^0,SF^1,... outermost first, e.g. 4,8")
      ->delimiter(',')
      ->required();
  cmd->add_option("--domains", opts->domains,
                  "Expert-domain sizes S^0,S^1,... each dividing its level size (default: all 1)")
      ->delimiter(',');
  cmd->add_flag("--json", opts->json, "Print JSON");
  cmd->add_flag("--pairs", opts->pairs, "Also list every ordered pair (m, n, level, type)");
  cmd->callback([opts, exit_code] { *exit_code = run_topology(*opts); });
}

}  // namespace xd::cli
