// Tests of the HybridEP topology (location renumbering, domains, the stricter
// pair rule, Table VII counts, reachability of every expert) and of the
// cluster section of job files (ClusterSpec, JobConfig).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster/job_config.h"
#include "cluster/topology.h"
#include "common/units.h"

namespace xd {
namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int s = 1; s <= n; ++s)
    if (n % s == 0) d.push_back(s);
  return d;
}

// Every domain-size vector of a layout.
std::vector<std::vector<int>> all_domain_sizes(const std::vector<int>& levels) {
  std::vector<std::vector<int>> out = {{}};
  for (int sf : levels) {
    std::vector<std::vector<int>> next;
    for (const auto& p : out)
      for (int s : divisors(sf)) {
        next.push_back(p);
        next.back().push_back(s);
      }
    out = next;
  }
  return out;
}

TEST(Topology, RenumberingFollowsEquation13) {
  for (const std::vector<int>& levels : {std::vector<int>{4, 4}, {2, 3, 4}, {8}, {3, 1, 2}}) {
    const Topology t(levels, std::vector<int>(levels.size(), 1));
    int g = 1;
    for (int s : levels) g *= s;
    ASSERT_EQ(t.world_size(), g);
    std::vector<int> previous;
    for (int m = 0; m < g; ++m) {
      const std::vector<int> loc = t.location(m);
      ASSERT_EQ(loc.size(), levels.size());
      for (size_t i = 0; i < levels.size(); ++i) {
        int below = 1;  // prod_{j>i} SF^j
        for (size_t j = i + 1; j < levels.size(); ++j) below *= levels[j];
        EXPECT_EQ(loc[i], (m / below) % levels[i]) << "m=" << m << " i=" << i;
      }
      EXPECT_EQ(loc.back(), m % levels.back());
      EXPECT_EQ(t.rank_of(loc), m);
      if (m > 0) {
        EXPECT_LT(previous, loc) << "locations count up in m (PyTorch order)";
      }
      previous = loc;
    }
  }
  // The paper's Figure 8(b): 4 DCs x 4 GPUs; GPU 6 is the third GPU of DC 1.
  EXPECT_EQ(Topology({4, 4}, {2, 4}).location(6), (std::vector<int>{1, 2}));
  EXPECT_EQ(Topology({2, 3, 4}, {1, 1, 1}).location(23), (std::vector<int>{1, 2, 3}));
}

TEST(Topology, DomainAndOffsetSplitTheCoordinate) {
  const Topology t({4, 8}, {2, 4});
  for (int m = 0; m < t.world_size(); ++m)
    for (int l = 0; l < 2; ++l) {
      const int x = t.location(m)[l], s = t.domain_sizes()[l];
      EXPECT_EQ(t.domain(m, l), x / s);
      EXPECT_EQ(t.offset(m, l), x % s);
      EXPECT_EQ(t.domain(m, l) * s + t.offset(m, l), x);
    }
}

TEST(Topology, OneLevelPairCountsAreThoseOfTableVII) {
  for (int g : {8, 16, 32})
    for (int s : divisors(g)) {
      const PairCounts c = Topology({g}, {s}).pair_counts(0);
      EXPECT_EQ(c.ag, (long long)g * (s - 1)) << "G=" << g << " S=" << s;
      EXPECT_EQ(c.a2a, (long long)g * (g / s - 1)) << "G=" << g << " S=" << s;
    }
  // Table VII as printed, EP size 8 and 16.
  const std::vector<std::pair<int, std::pair<long long, long long>>> g8 = {
      {1, {0, 56}}, {2, {8, 24}}, {4, {24, 8}}, {8, {56, 0}}};
  for (const auto& [s, counts] : g8) {
    const PairCounts c = Topology({8}, {s}).pair_counts(0);
    EXPECT_EQ(c.ag, counts.first);
    EXPECT_EQ(c.a2a, counts.second);
  }
  const std::vector<std::pair<int, std::pair<long long, long long>>> g16 = {
      {1, {0, 240}}, {2, {16, 112}}, {4, {48, 48}}, {8, {112, 16}}, {16, {240, 0}}};
  for (const auto& [s, counts] : g16) {
    const PairCounts c = Topology({16}, {s}).pair_counts(0);
    EXPECT_EQ(c.ag, counts.first);
    EXPECT_EQ(c.a2a, counts.second);
  }
}

TEST(Topology, InnermostLevelPairsNeverCrossADatacenter) {
  for (const auto& domains : all_domain_sizes({4, 4})) {
    const Topology t({4, 4}, domains);
    for (const TopologyPair& p : t.pairs()) {
      // Each level's pairs use that level's link class, and nothing else.
      EXPECT_EQ(link_level(t.level_sizes(), p.m, p.n), p.level);
      if (p.level == 1) {
        EXPECT_EQ(t.location(p.m)[0], t.location(p.n)[0]) << p.m << "->" << p.n;
      }
    }
  }
}

TEST(Topology, StricterRuleDropsThePairsAlgorithm1WouldLetCrossDatacenters) {
  // Algorithm 1 as printed checks only the deeper coordinates (l+1..), so at
  // the innermost level any two workers qualify, whatever their DCs.
  const Topology t({2, 4}, {1, 2});
  long long lax = 0, strict = 0;
  for (int m = 0; m < t.world_size(); ++m)
    for (int n = 0; n < t.world_size(); ++n) {
      const int xm = t.location(m)[1], xn = t.location(n)[1];
      const bool same_domain = xm / 2 == xn / 2;
      if ((same_domain && xm != xn) || (!same_domain && xm % 2 == xn % 2)) ++lax;
      if (t.pair_type(m, n, 1) != PairType::kNone) ++strict;
    }
  EXPECT_EQ(strict, t.pair_counts(1).ag + t.pair_counts(1).a2a);
  EXPECT_EQ(strict, 8 * 2);  // per worker: 1 AG peer, 1 A2A peer, in its own DC
  EXPECT_EQ(lax, 2 * strict);  // the other half would have crossed a DC
}

TEST(Topology, PairsAreSymmetricAndAgreeWithThePeerLists) {
  for (const std::vector<int>& levels : {std::vector<int>{4, 4}, {2, 3, 4}, {6}})
    for (const auto& domains : all_domain_sizes(levels)) {
      const Topology t(levels, domains);
      const auto pairs = t.pairs();
      std::set<std::tuple<int, int, int, int>> set;
      for (const auto& p : pairs) set.insert({p.m, p.n, p.level, static_cast<int>(p.type)});
      ASSERT_EQ(set.size(), pairs.size()) << "no duplicates";
      for (const auto& p : pairs)
        EXPECT_TRUE(set.count({p.n, p.m, p.level, static_cast<int>(p.type)})) << "symmetric";
      for (int m = 0; m < t.world_size(); ++m)
        for (int l = 0; l < t.num_levels(); ++l) {
          std::vector<int> ag, a2a;
          for (int n = 0; n < t.world_size(); ++n) {
            if (t.pair_type(m, n, l) == PairType::kAllGather) ag.push_back(n);
            if (t.pair_type(m, n, l) == PairType::kAllToAll) a2a.push_back(n);
          }
          EXPECT_EQ(t.ag_peers(m, l), ag);
          EXPECT_EQ(t.a2a_peers(m, l), a2a);
          EXPECT_EQ((int)ag.size(), domains[l] - 1);
          EXPECT_EQ((int)a2a.size(), levels[l] / domains[l] - 1);
          const auto group = t.level_group(m, l);
          EXPECT_EQ((int)group.size(), levels[l]);
          EXPECT_TRUE(std::is_sorted(group.begin(), group.end()));
        }
    }
}

// The AG outer level first: a worker ends up holding the experts of every
// owner whose coordinates lie in its own domain at every level.
std::vector<std::set<int>> gathered_experts(const Topology& t) {
  std::vector<std::set<int>> held(t.world_size());
  for (int m = 0; m < t.world_size(); ++m) held[m] = {m};
  for (int l = 0; l < t.num_levels(); ++l) {
    auto next = held;
    for (int m = 0; m < t.world_size(); ++m)
      for (int p : t.ag_peers(m, l)) next[m].insert(held[p].begin(), held[p].end());
    held = next;
  }
  return held;
}

TEST(Topology, DimensionOrderedExchangeReachesEveryExpertOwner) {
  for (const std::vector<int>& levels : {std::vector<int>{2, 2}, {4, 4}, {2, 3, 4}, {8}})
    for (const auto& domains : all_domain_sizes(levels)) {
      const Topology t(levels, domains);
      const auto held = gathered_experts(t);
      int prod = 1;
      for (int s : domains) prod *= s;
      for (int m = 0; m < t.world_size(); ++m) {
        EXPECT_EQ((int)held[m].size(), prod);
        for (int owner = 0; owner < t.world_size(); ++owner) {
          // Dispatch walks the levels in order: A2A into the owner's domain at
          // the same offset, or stay (that level's experts were gathered).
          int w = m;
          for (int l = 0; l < t.num_levels(); ++l) {
            const int target = t.location(owner)[l], s = domains[l];
            if (t.domain(w, l) == target / s) continue;  // AG or already there
            const int next = t.with_coordinate(w, l, (target / s) * s + t.offset(w, l));
            ASSERT_EQ(t.pair_type(w, next, l), PairType::kAllToAll)
                << t.describe() << " m=" << m << " owner=" << owner << " l=" << l;
            w = next;
          }
          EXPECT_TRUE(held[w].count(owner))
              << t.describe() << ": token of " << m << " for owner " << owner << " ends at " << w;
        }
      }
    }
}

TEST(Topology, RejectsBadShapesWithClearErrors) {
  auto bad = Topology::create({4, 8}, {3, 4});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("domain size 3 does not divide the level size 4"),
            std::string::npos)
      << bad.status().message();
  EXPECT_FALSE(Topology::create({4, 8}, {2}));
  EXPECT_FALSE(Topology::create({}, {}));
  EXPECT_FALSE(Topology::create({0}, {1}));
  EXPECT_FALSE(Topology::create({4}, {0}));
  EXPECT_FALSE(Topology::create({256, 256}, {1, 1}));  // more than 65535 workers
  EXPECT_TRUE(Topology::create({4, 8}, {2, 4}));
}

TEST(Topology, LinkLevelIsTheFirstDifferingCoordinate) {
  const std::vector<int> levels = {2, 3, 4};
  const Topology t(levels, {1, 1, 1});
  for (int m = 0; m < t.world_size(); ++m)
    for (int n = 0; n < t.world_size(); ++n) {
      int expected = -1;
      for (int l = 2; l >= 0; --l)
        if (t.location(m)[l] != t.location(n)[l]) expected = l;
      EXPECT_EQ(link_level(levels, m, n), expected);
    }
}

// Runs `xdmoe <args>` with stderr folded into stdout; returns the exit code.
int run_xdmoe(const std::string& args, std::string* output) {
  const std::string cmd = std::string(XD_BINARY_DIR) + "/xdmoe " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return -1;
  char buf[4096];
  size_t got;
  output->clear();
  while ((got = std::fread(buf, 1, sizeof buf, pipe)) > 0) output->append(buf, got);
  const int status = ::pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(TopologyCommand, PrintsTableVIICountsAsJson) {
  std::string out;
  ASSERT_EQ(run_xdmoe("topology --levels 8 --domains 2 --json --pairs", &out), 0) << out;
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["per_level"][0]["ag_pairs"], 8);
  EXPECT_EQ(j["per_level"][0]["a2a_pairs"], 24);
  EXPECT_EQ(j["pairs"].size(), 32u);

  EXPECT_EQ(run_xdmoe("topology --levels 4,8 --domains 3,4", &out), 2);
  EXPECT_NE(out.find("domain size 3 does not divide the level size 4"), std::string::npos) << out;
}

// ---- cluster section --------------------------------------------------------

TEST(ClusterSpec, DefaultIsTwoDatacentersOfTwoWorkers) {
  const ClusterSpec c = default_cluster_spec();
  EXPECT_TRUE(c.validate().is_ok());
  EXPECT_EQ(c.level_sizes(), (std::vector<int>{2, 2}));
  EXPECT_EQ(c.world_size(), 4);
  EXPECT_DOUBLE_EQ(c.levels[0].link.bandwidth_bytes_per_s, 100e6 / 8);
  EXPECT_DOUBLE_EQ(c.levels[0].link.latency_s, 0.010);
  EXPECT_DOUBLE_EQ(c.levels[1].link.bandwidth_bytes_per_s, 1e9 / 8);
  EXPECT_DOUBLE_EQ(c.levels[1].link.latency_s, 0.0002);
  EXPECT_TRUE(c.levels[0].link.shape && c.levels[1].link.shape);
  EXPECT_EQ(c.expert_parallel.mode, EpMode::kAuto);
  EXPECT_DOUBLE_EQ(c.expert_parallel.memory_cap_bytes, 64e6);
  const JobConfig job = default_job_config();
  EXPECT_EQ(job.train.model.num_experts % job.cluster.world_size(), 0);
}

TEST(ClusterSpec, ParsesTheExampleJobFiles) {
  auto two = load_job_config(std::string(XD_SOURCE_DIR) + "/examples/2dc.yaml");
  ASSERT_TRUE(two) << two.status().message();
  EXPECT_EQ(two->cluster.world_size(), 4);
  EXPECT_EQ(two->cluster.levels[0].name, "dc");
  EXPECT_EQ(two->cluster.levels[1].name, "worker");
  EXPECT_EQ(two->cluster.levels[0].link.name, "dc");
  EXPECT_DOUBLE_EQ(two->cluster.levels[0].link.bandwidth_bytes_per_s, 12.5e6);
  EXPECT_DOUBLE_EQ(two->cluster.levels[0].link.latency_s, 0.010);
  EXPECT_LT(two->cluster.levels[0].link.bandwidth_bytes_per_s,
            two->cluster.levels[1].link.bandwidth_bytes_per_s / 5);
  EXPECT_EQ(two->cluster.expert_parallel.mode, EpMode::kAuto);
  EXPECT_DOUBLE_EQ(two->cluster.expert_parallel.memory_cap_bytes, 64e6);
  EXPECT_LT(two->train.steps, 300);

  auto four = load_job_config(std::string(XD_SOURCE_DIR) + "/examples/4dc.yaml");
  ASSERT_TRUE(four) << four.status().message();
  EXPECT_EQ(four->cluster.level_sizes(), (std::vector<int>{4, 2}));
  EXPECT_EQ(four->train.model.num_experts % 8, 0);
}

TEST(ClusterSpec, ReadsEveryKey) {
  const std::string yaml = R"(
model: {num_experts: 8}
cluster:
  levels:
    - name: region
      size: 2
      link:
        bandwidth: 20mbit
        latency: 30ms
        shape: false
        codecs: {dispatch: bf16, combine: "topk:0.5+zstd:2", expert_gather: "sr:ef:topk:0.02+zstd:1",
                 expert_grad: "ef:topk:0.1", dense_grad: bf16}
    - name: node
      size: 4
      link: {bandwidth: 10MB/s, latency: 250us}
  hosts:
    - {host: 10.0.0.1, dc: 0, slots: 4}
    - {host: 10.0.1.1, dc: 1, slots: 2}
    - {host: 10.0.1.2, dc: 1, slots: 2}
  expert_parallel:
    mode: hybrid
    domain_sizes: [1, 2]
    memory_cap: 1.5MiB
    base_sync_every: 10
    base_codec: sign
    fused_encode: false
    pipeline_degree: 4
    replica_weight_gradients: late
)";
  auto c = parse_cluster_spec(yaml, "job.yaml");
  ASSERT_TRUE(c) << c.status().message();
  EXPECT_EQ(c->level_sizes(), (std::vector<int>{2, 4}));
  EXPECT_DOUBLE_EQ(c->levels[0].link.bandwidth_bytes_per_s, 2.5e6);
  EXPECT_DOUBLE_EQ(c->levels[0].link.latency_s, 0.030);
  EXPECT_FALSE(c->levels[0].link.shape);
  EXPECT_EQ(c->levels[0].link.codecs.dispatch, "bf16");
  EXPECT_EQ(c->levels[0].link.codecs.combine, "topk:0.5+zstd:2");
  EXPECT_EQ(c->levels[0].link.codecs.expert_gather, "sr:ef:topk:0.02+zstd:1");
  EXPECT_EQ(c->levels[0].link.codecs.expert_grad, "ef:topk:0.1");
  EXPECT_EQ(c->levels[0].link.codecs.dense_grad, "bf16");
  EXPECT_EQ(c->expert_parallel.base_sync_every, 10);
  EXPECT_EQ(c->expert_parallel.base_codec, "sign");
  EXPECT_FALSE(c->expert_parallel.fused_encode);
  EXPECT_EQ(c->expert_parallel.pipeline_degree, 4);
  EXPECT_EQ(c->expert_parallel.replica_weight_gradients, ReplicaWeightGradients::kLate);
  auto automatic = parse_cluster_spec("cluster:\n  expert_parallel: {pipeline_degree: auto}\n", "job.yaml");
  ASSERT_TRUE(automatic) << automatic.status().message();
  EXPECT_TRUE(automatic->expert_parallel.fused_encode) << "fused unless the config says otherwise";
  EXPECT_EQ(automatic->expert_parallel.tokens_once_per_worker, TokensOncePerWorker::kAuto)
      << "the planner chooses unless the config says otherwise";
  for (const auto& [text, want] : {std::pair<const char*, TokensOncePerWorker>{"true", TokensOncePerWorker::kOn},
                                   {"True", TokensOncePerWorker::kOn},
                                   {"false", TokensOncePerWorker::kOff},
                                   {"off", TokensOncePerWorker::kOff},
                                   {"auto", TokensOncePerWorker::kAuto}}) {
    auto once = parse_cluster_spec(std::string("cluster:\n  expert_parallel: {tokens_once_per_worker: ") + text + "}\n",
                                   "job.yaml");
    ASSERT_TRUE(once) << once.status().message();
    EXPECT_EQ(once->expert_parallel.tokens_once_per_worker, want) << text;
  }
  EXPECT_EQ(automatic->expert_parallel.pipeline_degree, 0) << "auto: the planner chooses";
  EXPECT_EQ(automatic->expert_parallel.replica_weight_gradients, ReplicaWeightGradients::kAuto)
      << "the planner chooses unless the config says otherwise";
  EXPECT_EQ(automatic->expert_parallel.backward_pipeline_degree, -1) << "not given: follows the forward's";
  auto per_direction = parse_cluster_spec(
      "cluster:\n  expert_parallel: {pipeline_degree: 4, backward_pipeline_degree: 2}\n", "job.yaml");
  ASSERT_TRUE(per_direction) << per_direction.status().message();
  EXPECT_EQ(per_direction->expert_parallel.backward_pipeline_degree, 2);
  auto backward_auto = parse_cluster_spec(
      "cluster:\n  expert_parallel: {pipeline_degree: 4, backward_pipeline_degree: auto}\n", "job.yaml");
  ASSERT_TRUE(backward_auto) << backward_auto.status().message();
  EXPECT_EQ(backward_auto->expert_parallel.backward_pipeline_degree, 0) << "auto: the planner chooses";
  EXPECT_EQ(c->levels[1].link.codecs.dispatch, "raw") << "raw unless a link class says otherwise";
  EXPECT_EQ(c->levels[1].link.codecs.expert_gather, "raw");
  EXPECT_EQ(c->levels[1].link.codecs.dense_grad, "raw");
  EXPECT_DOUBLE_EQ(c->levels[1].link.bandwidth_bytes_per_s, 10e6);
  EXPECT_DOUBLE_EQ(c->levels[1].link.latency_s, 250e-6);
  EXPECT_TRUE(c->levels[1].link.shape);
  ASSERT_EQ(c->hosts.size(), 3u);
  EXPECT_EQ(c->hosts[2].host, "10.0.1.2");
  EXPECT_EQ(c->hosts[2].dc, 1);
  EXPECT_EQ(c->hosts[2].slots, 2);
  EXPECT_EQ(c->expert_parallel.mode, EpMode::kHybrid);
  EXPECT_EQ(c->expert_parallel.domain_sizes, (std::vector<int>{1, 2}));
  EXPECT_DOUBLE_EQ(c->expert_parallel.memory_cap_bytes, 1.5 * 1024 * 1024);
  auto job = parse_job_config(yaml, "job.yaml");
  ASSERT_TRUE(job) << job.status().message();
  EXPECT_EQ(job->train.model.num_experts, 8);
}

TEST(ClusterSpec, MissingSectionMeansTheDefaultAndOtherSectionsAreNotItsBusiness) {
  auto c = parse_cluster_spec("model: {hidden_size: 64}\nwhatever: 3\n", "job.yaml");
  ASSERT_TRUE(c) << c.status().message();
  EXPECT_EQ(c->level_sizes(), default_cluster_spec().level_sizes());
  auto empty = parse_cluster_spec("", "job.yaml");
  ASSERT_TRUE(empty);
  EXPECT_EQ(empty->world_size(), 4);
}

TEST(ClusterSpec, ModeEpMeansAllOnesAndNewLevelsDefaultToOnes) {
  auto ep = parse_cluster_spec("cluster:\n  expert_parallel: {mode: ep, domain_sizes: [2, 2]}\n", "j.yaml");
  ASSERT_TRUE(ep) << ep.status().message();
  EXPECT_EQ(ep->expert_parallel.domain_sizes, (std::vector<int>{1, 1}));
  auto three = parse_cluster_spec(R"(cluster:
  levels:
    - {name: a, size: 2, link: {bandwidth: 1mbit}}
    - {name: b, size: 3, link: {bandwidth: 1gbit}}
    - {name: c, size: 2, link: {bandwidth: 10gbit}}
  expert_parallel: {memory_cap: unlimited}
)", "j.yaml");
  ASSERT_TRUE(three) << three.status().message();
  EXPECT_EQ(three->expert_parallel.domain_sizes, (std::vector<int>{1, 1, 1}));
  EXPECT_TRUE(std::isinf(three->expert_parallel.memory_cap_bytes));
  EXPECT_DOUBLE_EQ(three->levels[0].link.latency_s, 0.0);
}

TEST(ClusterSpec, ErrorsNameFileLineAndKey) {
  struct Case {
    std::string yaml, expected;
  };
  const std::vector<Case> cases = {
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      sizes: 3\n",
       "job.yaml:5: cluster.levels[0].sizes: unknown key"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 100 furlongs}\n",
       "job.yaml:5: cluster.levels[0].link.bandwidth: bad bandwidth unit"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link: {bandwidth: 1gbit, latency: 3 days}\n",
       "job.yaml:5: cluster.levels[0].link.latency: bad duration unit"},
      {"cluster:\n  levels:\n    - name: dc\n      link: {bandwidth: 1gbit}\n",
       "job.yaml:3: cluster.levels[0].size: missing (required)"},
      {"cluster:\n  levels:\n    - name: dc\n      size: two\n      link: {bandwidth: 1gbit}\n",
       "job.yaml:4: cluster.levels[0].size: expected an integer"},
      {"cluster:\n  expert_parallel:\n    mode: hybrid\n    domain_sizes:\n      - 2\n      - 3\n",
       "job.yaml:6: cluster.expert_parallel.domain_sizes[1]: domain size 3 does not divide the size 2"},
      {"cluster:\n  expert_parallel:\n    mode: hybrid\n",
       "job.yaml:3: cluster.expert_parallel.domain_sizes: required for mode hybrid"},
      {"cluster:\n  expert_parallel:\n    domain_sizes: [1]\n",
       "job.yaml:3: cluster.expert_parallel.domain_sizes: needs one entry per level"},
      {"cluster:\n  expert_parallel:\n    mode: fastest\n",
       "job.yaml:3: cluster.expert_parallel.mode: unknown mode 'fastest'"},
      {"cluster:\n  expert_parallel:\n    memory_cap: 64 parsecs\n",
       "job.yaml:3: cluster.expert_parallel.memory_cap: bad size unit"},
      {"cluster:\n  hosts:\n    - {host: a, dc: 0, slots: 2}\n    - {host: b, dc: 0, slots: 2}\n",
       "job.yaml:3: cluster.hosts: coordinate 0 of level 'dc' has 4 slots, expected 2"},
      {"cluster:\n  hosts:\n    - {host: a, dc: 5, slots: 2}\n",
       "job.yaml:3: cluster.hosts[0].dc: must be in 0..1"},
      {"cluster:\n  levels:\n    - {name: dc, size: 2, link: {bandwidth: 1gbit}}\n"
       "    - {name: dc, size: 2, link: {bandwidth: 1gbit}}\n",
       "job.yaml:4: cluster.levels[1].name: duplicate level name 'dc'"},
      {"cluster:\n  levels: []\n", "job.yaml:2: cluster.levels: must be a non-empty list"},
      {"cluster:\n  nodes: 3\n", "job.yaml:2: cluster.nodes: unknown key"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {dispatch: bf17}\n",
       "job.yaml:7: cluster.levels[0].link.codecs.dispatch: codec 'bf17': unknown stage 'bf17'"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {gather: bf16}\n",
       "job.yaml:7: cluster.levels[0].link.codecs.gather: unknown key"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {expert_grad: \"sr:topk:0.1\"}\n",
       "cluster.levels[0].link.codecs.expert_grad: 'sr:' applies to weights only"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {expert_grad: \"delta:zstd:1\"}\n",
       "cluster.levels[0].link.codecs.expert_grad: 'delta:' codes weights only"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {expert_gather: \"delta:int8_row\"}\n",
       "cluster.levels[0].link.codecs.expert_gather: expert codec 'delta:int8_row': delta: sends exact bit "
       "differences; its pipeline must be lossless"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {expert_gather: \"sr:topk:2\"}\n",
       "cluster.levels[0].link.codecs.expert_gather: expert codec 'sr:topk:2'"},
      {"cluster:\n  levels:\n    - name: dc\n      size: 2\n      link:\n        bandwidth: 1gbit\n"
       "        codecs: {dense_grad: int8_row}\n",
       "cluster.levels[0].link.codecs.dense_grad: 'int8_row' is not a dense-gradient codec (use raw or bf16)"},
      {"cluster:\n  expert_parallel: {base_sync_every: -1}\n",
       "cluster.expert_parallel.base_sync_every: must be >= 0"},
      {"cluster:\n  expert_parallel: {fused_encode: sometimes}\n", "cluster.expert_parallel.fused_encode"},
      {"cluster:\n  expert_parallel: {tokens_once_per_worker: twice}\n",
       "cluster.expert_parallel.tokens_once_per_worker: expected auto, true or false"},
      {"cluster:\n  expert_parallel: {replica_weight_gradients: soon}\n",
       "cluster.expert_parallel.replica_weight_gradients: unknown value 'soon' (use auto, early or late)"},
      {"cluster:\n  expert_parallel: {base_codec: int8}\n",
       "cluster.expert_parallel.base_codec: must be bf16 or sign, not 'int8'"},
      {"cluster:\n  expert_parallel: {pipeline_degree: 0}\n",
       "cluster.expert_parallel.pipeline_degree: must be auto or a chunk count of at least 1"},
      {"cluster:\n  expert_parallel: {pipeline_degree: many}\n", "cluster.expert_parallel.pipeline_degree"},
      {"cluster:\n  expert_parallel: {pipeline_degree: 4, backward_pipeline_degree: 3}\n",
       "cluster.expert_parallel.backward_pipeline_degree: 3 does not divide pipeline_degree 4"},
      {"cluster:\n  expert_parallel: {backward_pipeline_degree: 0}\n",
       "cluster.expert_parallel.backward_pipeline_degree: must be auto or a chunk count of at least 1"},
      {"cluster: [1, 2]\n", "job.yaml:1: cluster: must be a mapping"},
      {"cluster:\n  levels: [\n", "YAML syntax error"},
  };
  for (const Case& c : cases) {
    auto r = parse_cluster_spec(c.yaml, "job.yaml");
    ASSERT_FALSE(r) << c.yaml;
    EXPECT_NE(r.status().message().find(c.expected), std::string::npos)
        << "got: " << r.status().message() << "\nwanted: " << c.expected;
  }
}

TEST(ClusterSpec, JobNeedsExpertsToSplitEvenlyOverTheWorkers) {
  auto job = parse_job_config("model: {num_experts: 6}\n", "job.yaml");
  ASSERT_FALSE(job);
  EXPECT_NE(job.status().message().find("model.num_experts (6) must be a multiple of the world size (4"),
            std::string::npos)
      << job.status().message();
  // A typo in the train sections is still the train parser's error.
  auto typo = parse_job_config("train: {stepz: 3}\ncluster: {}\n", "job.yaml");
  ASSERT_FALSE(typo);
  EXPECT_NE(typo.status().message().find("train.stepz"), std::string::npos);
}

TEST(ClusterSpec, ByteSizesUseDecimalAndBinaryUnits) {
  EXPECT_DOUBLE_EQ(*parse_byte_size("64MB"), 64e6);
  EXPECT_DOUBLE_EQ(*parse_byte_size("64 MiB"), 64.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(*parse_byte_size("512"), 512);
  EXPECT_DOUBLE_EQ(*parse_byte_size("2kb"), 2000);
  EXPECT_TRUE(std::isinf(*parse_byte_size("unlimited")));
  EXPECT_FALSE(parse_byte_size("-1MB"));
  EXPECT_FALSE(parse_byte_size("MB"));
  EXPECT_FALSE(parse_byte_size("3 bananas"));
}

TEST(ClusterSpec, ValidateNamesTheKey) {
  ClusterSpec c = default_cluster_spec();
  c.expert_parallel.domain_sizes = {2, 3};
  EXPECT_NE(c.validate().message().find("cluster.expert_parallel.domain_sizes[1]"), std::string::npos);
  c = default_cluster_spec();
  c.levels[1].link.bandwidth_bytes_per_s = 0;
  EXPECT_NE(c.validate().message().find("cluster.levels[1].link.bandwidth"), std::string::npos);
}

}  // namespace
}  // namespace xd
