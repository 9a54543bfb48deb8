#include "cluster/cluster_spec.h"

#include "common/atomic_file.h"
#include "common/yaml_reader.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "common/units.h"
#include "compression/codec.h"
#include "compression/expert_codec.h"

namespace xd {

const char* ep_mode_name(EpMode m) {
  switch (m) {
    case EpMode::kEp: return "ep";
    case EpMode::kHybrid: return "hybrid";
    case EpMode::kAuto: return "auto";
  }
  return "?";
}

Expected<EpMode> parse_ep_mode(const std::string& s) {
  if (s == "ep") return EpMode::kEp;
  if (s == "hybrid") return EpMode::kHybrid;
  if (s == "auto") return EpMode::kAuto;
  return Status::invalid_argument("unknown mode '" + s + "' (use ep, hybrid or auto)");
}

const char* replica_weight_gradients_name(ReplicaWeightGradients w) {
  switch (w) {
    case ReplicaWeightGradients::kAuto: return "auto";
    case ReplicaWeightGradients::kEarly: return "early";
    case ReplicaWeightGradients::kLate: return "late";
  }
  return "?";
}

Expected<ReplicaWeightGradients> parse_replica_weight_gradients(const std::string& s) {
  if (s == "auto") return ReplicaWeightGradients::kAuto;
  if (s == "early") return ReplicaWeightGradients::kEarly;
  if (s == "late") return ReplicaWeightGradients::kLate;
  return Status::invalid_argument("unknown value '" + s + "' (use auto, early or late)");
}

const char* tokens_once_per_worker_name(TokensOncePerWorker t) {
  switch (t) {
    case TokensOncePerWorker::kOff: return "false";
    case TokensOncePerWorker::kOn: return "true";
    case TokensOncePerWorker::kAuto: return "auto";
  }
  return "?";
}

Expected<TokensOncePerWorker> parse_tokens_once_per_worker(const std::string& s) {
  if (s == "auto") return TokensOncePerWorker::kAuto;
  if (s == "true") return TokensOncePerWorker::kOn;
  if (s == "false") return TokensOncePerWorker::kOff;
  return Status::invalid_argument("unknown value '" + s + "' (use auto, true or false)");
}

int ClusterSpec::world_size() const {
  int g = 1;
  for (const LevelSpec& l : levels) g *= l.size;
  return g;
}

bool ClusterSpec::base_as_signs(size_t level, bool gather_against_base) const {
  return gather_against_base && level + 1 < levels.size() && expert_parallel.base_codec == "sign";
}

std::vector<int> ClusterSpec::level_sizes() const {
  std::vector<int> s;
  for (const LevelSpec& l : levels) s.push_back(l.size);
  return s;
}

ClusterSpec default_cluster_spec() {
  ClusterSpec c;
  c.levels = {
      LevelSpec{"dc", 2, LinkClassSpec{"dc", 100e6 / 8, 10e-3, true, {}}},
      LevelSpec{"worker", 2, LinkClassSpec{"worker", 1e9 / 8, 0.2e-3, true, {}}},
  };
  c.expert_parallel.mode = EpMode::kAuto;
  c.expert_parallel.domain_sizes = {1, 1};
  c.expert_parallel.memory_cap_bytes = 64e6;
  return c;
}


int link_level(const std::vector<int>& level_sizes, int m, int n) {
  int stride = 1;
  for (int s : level_sizes) stride *= s;
  XD_CHECK(m >= 0 && m < stride && n >= 0 && n < stride);
  for (size_t l = 0; l < level_sizes.size(); ++l) {
    stride /= level_sizes[l];
    if ((m / stride) % level_sizes[l] != (n / stride) % level_sizes[l]) return static_cast<int>(l);
  }
  return -1;
}

namespace {
// Both by_kind()s: String is std::string or const std::string.
template <typename String, typename Codecs>
std::vector<std::pair<const char*, String*>> codecs_by_kind(Codecs& c) {
  return {{"dispatch", &c.dispatch}, {"combine", &c.combine}, {"expert_gather", &c.expert_gather},
          {"expert_grad", &c.expert_grad}, {"dense_grad", &c.dense_grad}};
}
}  // namespace

std::vector<std::pair<const char*, std::string*>> LinkCodecs::by_kind() {
  return codecs_by_kind<std::string>(*this);
}

std::vector<std::pair<const char*, const std::string*>> LinkCodecs::by_kind() const {
  return codecs_by_kind<const std::string>(*this);
}

namespace {

// The first bad codec spec of a link class, as (traffic kind, why).
std::optional<std::pair<std::string, std::string>> codec_issue(const LinkCodecs& c) {
  for (const auto& [kind, spec] : {std::pair{"dispatch", &c.dispatch}, {"combine", &c.combine}})
    if (auto p = CodecPipeline::parse(*spec); !p) return std::pair{kind, p.status().message()};
  for (const auto& [kind, spec] : {std::pair{"expert_gather", &c.expert_gather}, {"expert_grad", &c.expert_grad}}) {
    auto e = ExpertCodecSpec::parse(*spec);
    if (!e) return std::pair{kind, e.status().message()};
    if (e->against_base && std::string(kind) == "expert_grad")
      return std::pair{kind, "'sr:' applies to weights only; gradients have no base"};
    if (e->predict && std::string(kind) == "expert_grad")
      return std::pair{kind, "'pred:' predicts weights only; gradients are not a trajectory"};
    if (e->bit_delta && std::string(kind) == "expert_grad")
      return std::pair{kind, "'delta:' codes weights only; a step's gradients are not the last step's plus a little"};
  }
  if (c.dense_grad != "raw" && c.dense_grad != "bf16")
    return std::pair{"dense_grad", "'" + c.dense_grad + "' is not a dense-gradient codec (use raw or bf16)"};
  return std::nullopt;
}

std::string level_key(size_t i) { return "cluster.levels[" + std::to_string(i) + "]"; }

// The first rule `c` breaks, as (key, why).
std::optional<std::pair<std::string, std::string>> first_issue(const ClusterSpec& c) {
  using Issue = std::pair<std::string, std::string>;
  if (c.levels.empty()) return Issue{"cluster.levels", "at least one level is required"};
  std::set<std::string> names;
  long long g = 1;
  for (size_t i = 0; i < c.levels.size(); ++i) {
    const LevelSpec& l = c.levels[i];
    const std::string k = level_key(i);
    if (l.name.empty()) return Issue{k + ".name", "must not be empty"};
    if (!names.insert(l.name).second) return Issue{k + ".name", "duplicate level name '" + l.name + "'"};
    if (l.size < 1) return Issue{k + ".size", "must be at least 1"};
    g *= l.size;
    if (g > 65535) return Issue{k + ".size", "the world size (product of level sizes) exceeds 65535"};
    if (!(l.link.bandwidth_bytes_per_s > 0) || !std::isfinite(l.link.bandwidth_bytes_per_s))
      return Issue{k + ".link.bandwidth", "must be positive"};
    if (!(l.link.latency_s >= 0) || !std::isfinite(l.link.latency_s))
      return Issue{k + ".link.latency", "must be >= 0"};
    if (auto issue = codec_issue(l.link.codecs)) return Issue{k + ".link.codecs." + issue->first, issue->second};
  }
  const ExpertParallelSpec& ep = c.expert_parallel;
  if (ep.domain_sizes.size() != c.levels.size())
    return Issue{"cluster.expert_parallel.domain_sizes",
                 "needs one entry per level (" + std::to_string(c.levels.size()) + "), got " +
                     std::to_string(ep.domain_sizes.size())};
  for (size_t i = 0; i < ep.domain_sizes.size(); ++i) {
    const int s = ep.domain_sizes[i], sf = c.levels[i].size;
    const std::string k = "cluster.expert_parallel.domain_sizes[" + std::to_string(i) + "]";
    if (s < 1) return Issue{k, "must be at least 1"};
    if (sf % s != 0)
      return Issue{k, "domain size " + std::to_string(s) + " does not divide the size " +
                          std::to_string(sf) + " of level '" + c.levels[i].name + "'"};
  }
  if (ep.mode == EpMode::kEp)
    for (int s : ep.domain_sizes)
      if (s != 1) return Issue{"cluster.expert_parallel.domain_sizes", "mode ep means all 1s"};
  if (!(ep.memory_cap_bytes >= 0)) return Issue{"cluster.expert_parallel.memory_cap", "must be >= 0"};
  if (ep.base_sync_every < 0) return Issue{"cluster.expert_parallel.base_sync_every", "must be >= 0"};
  if (ep.base_codec != "bf16" && ep.base_codec != "sign")
    return Issue{"cluster.expert_parallel.base_codec", "must be bf16 or sign, not '" + ep.base_codec + "'"};
  if (ep.pipeline_degree < 0 || ep.pipeline_degree > 64)
    return Issue{"cluster.expert_parallel.pipeline_degree", "must be auto or 1..64"};
  if (ep.backward_pipeline_degree < -1 || ep.backward_pipeline_degree > 64)
    return Issue{"cluster.expert_parallel.backward_pipeline_degree", "must be auto or 1..64"};
  if (ep.pipeline_degree > 0 && ep.backward_pipeline_degree > 0 &&
      ep.pipeline_degree % ep.backward_pipeline_degree != 0)
    return Issue{"cluster.expert_parallel.backward_pipeline_degree",
                 std::to_string(ep.backward_pipeline_degree) + " does not divide pipeline_degree " +
                     std::to_string(ep.pipeline_degree) + ": each backward exchange carries whole forward chunks"};
  if (!c.hosts.empty()) {
    const int g0 = c.levels[0].size;
    std::vector<long long> per_dc(g0, 0);
    long long total = 0;
    for (size_t i = 0; i < c.hosts.size(); ++i) {
      const HostSpec& h = c.hosts[i];
      const std::string k = "cluster.hosts[" + std::to_string(i) + "]";
      if (h.host.empty()) return Issue{k + ".host", "must not be empty"};
      // dc -1 on every host: the hosts fill the ranks in order (hostfiles without dc=).
      const bool by_order = c.hosts.front().dc == -1;
      if (by_order != (h.dc == -1))
        return Issue{k + ".dc", "give a dc to every host or to none"};
      if (!by_order && (h.dc < 0 || h.dc >= g0))
        return Issue{k + ".dc", "must be in 0.." + std::to_string(g0 - 1) + " (level '" +
                                    c.levels[0].name + "' has size " + std::to_string(g0) + ")"};
      if (h.slots < 1) return Issue{k + ".slots", "must be at least 1"};
      if (!by_order) per_dc[h.dc] += h.slots;
      total += h.slots;
    }
    if (total != g)
      return Issue{"cluster.hosts", "the slots add up to " + std::to_string(total) +
                                        ", but the levels describe " + std::to_string(g) + " workers"};
    for (int d = 0; d < g0 && c.hosts.front().dc != -1; ++d)
      if (per_dc[d] != g / g0)
        return Issue{"cluster.hosts", "coordinate " + std::to_string(d) + " of level '" +
                                          c.levels[0].name + "' has " + std::to_string(per_dc[d]) +
                                          " slots, expected " + std::to_string(g / g0)};
  }
  return std::nullopt;
}


void read_level(YamlReader& r, const YAML::Node& node, const std::string& k, LevelSpec* level) {
  r.section(node, k, {"name", "size", "link"}, {"name", "size", "link"},
            [&](const std::string& key, const YAML::Node& v, const std::string& full) {
    if (key == "name") r.get(v, full, &level->name);
    else if (key == "size") r.get(v, full, &level->size);
    else {
      level->link = LinkClassSpec{};
      r.section(v, full, {"bandwidth", "latency", "shape", "codecs"}, {"bandwidth"},
                [&](const std::string& lk, const YAML::Node& lv, const std::string& lfull) {
        if (lk == "bandwidth") r.get_unit(lv, lfull, &level->link.bandwidth_bytes_per_s, parse_bandwidth);
        else if (lk == "latency") r.get_unit(lv, lfull, &level->link.latency_s, parse_duration);
        else if (lk == "shape") r.get(lv, lfull, &level->link.shape);
        else
          r.section(lv, lfull, {"dispatch", "combine", "expert_gather", "expert_grad", "dense_grad"},
                    [&](const std::string& ck, const YAML::Node& cv, const std::string& cfull) {
            // Checked with every other rule, by first_issue().
            for (auto [kind, spec] : level->link.codecs.by_kind())
              if (ck == kind) r.get(cv, cfull, spec);
          });
      });
    }
  });
  level->link.name = level->name;
}

void read_hosts(YamlReader& r, const YAML::Node& node, std::vector<HostSpec>* hosts) {
  if (!node.IsSequence()) return r.fail(node, "cluster.hosts", "must be a list");
  hosts->clear();
  for (size_t i = 0; i < node.size() && r.ok(); ++i) {
    HostSpec h;
    const std::string k = "cluster.hosts[" + std::to_string(i) + "]";
    r.section(node[i], k, {"host", "dc", "slots"}, {"host"},
              [&](const std::string& key, const YAML::Node& v, const std::string& full) {
      if (key == "host") r.get(v, full, &h.host);
      else if (key == "dc") r.get(v, full, &h.dc);
      else r.get(v, full, &h.slots);
    });
    hosts->push_back(h);
  }
}

}  // namespace

Status ClusterSpec::validate() const {
  auto issue = first_issue(*this);
  if (issue) return Status::invalid_argument(issue->first + ": " + issue->second);
  return Status::ok();
}

Expected<ClusterSpec> parse_cluster_spec(const std::string& text, const std::string& source) {
  auto document = load_yaml_document(text, source);
  if (!document) return document.status();
  const YAML::Node root = *document;
  ClusterSpec c = default_cluster_spec();
  if (!root || root.IsNull()) return c;
  if (!root.IsMap()) return Status::invalid_argument(source + ": the top level must be a mapping");
  const YAML::Node node = root["cluster"];
  if (!node) return c;

  YamlReader r(source);
  bool levels_given = false, domains_given = false;
  r.section(node, "cluster", {"levels", "hosts", "expert_parallel", "security"}, {},
            [&](const std::string& key, const YAML::Node& v, const std::string& full) {
    if (key == "levels") {
      levels_given = true;
      if (!v.IsSequence() || v.size() == 0)
        return r.fail(v, full, "must be a non-empty list of levels, outermost first");
      c.levels.clear();
      for (size_t i = 0; i < v.size() && r.ok(); ++i) {
        LevelSpec level;
        read_level(r, v[i], level_key(i), &level);
        c.levels.push_back(level);
      }
    } else if (key == "hosts") {
      read_hosts(r, v, &c.hosts);
    } else if (key == "security") {
      SecuritySpec& s = c.security;
      s.configured = true;
      r.section(v, full, {"insecure", "coordinator_key", "coordinator_public_key", "worker_key", "allowed_keys",
                          "read_only_any_key"}, {},
                [&](const std::string& sk, const YAML::Node& sv, const std::string& sfull) {
        if (sk == "insecure") r.get(sv, sfull, &s.insecure);
        else if (sk == "coordinator_key") r.get(sv, sfull, &s.coordinator_key);
        else if (sk == "coordinator_public_key") r.get(sv, sfull, &s.coordinator_public_key);
        else if (sk == "worker_key") r.get(sv, sfull, &s.worker_key);
        else if (sk == "read_only_any_key") r.get(sv, sfull, &s.read_only_any_key);
        else {
          if (!sv.IsSequence()) return r.fail(sv, sfull, "must be a list of .pub files or Z85 public keys");
          s.allowed_keys.clear();
          for (size_t i = 0; i < sv.size() && r.ok(); ++i) {
            std::string k;
            r.get(sv[i], sfull + "[" + std::to_string(i) + "]", &k);
            s.allowed_keys.push_back(k);
          }
        }
      });
      if (r.ok() && !s.insecure && (s.coordinator_public_key.empty() || s.allowed_keys.empty()))
        r.fail(v, full, "needs coordinator_public_key and allowed_keys (make them with `xdmoe keygen`), or insecure: true");
    } else {
      ExpertParallelSpec& ep = c.expert_parallel;
      r.section(v, full, {"mode", "domain_sizes", "memory_cap", "base_sync_every", "base_codec", "fused_encode",
                                 "pipeline_degree", "backward_pipeline_degree", "replica_weight_gradients",
                                 "tokens_once_per_worker"}, {},
                [&](const std::string& ek, const YAML::Node& ev, const std::string& efull) {
        if (ek == "mode") {
          std::string s;
          r.get(ev, efull, &s);
          if (!r.ok()) return;
          auto m = parse_ep_mode(s);
          if (!m) return r.fail(ev, efull, m.status().message());
          ep.mode = *m;
        } else if (ek == "domain_sizes") {
          domains_given = true;
          if (!ev.IsSequence()) return r.fail(ev, efull, "must be a list with one size per level");
          ep.domain_sizes.clear();
          for (size_t i = 0; i < ev.size() && r.ok(); ++i) {
            int s = 0;
            const std::string ik = efull + "[" + std::to_string(i) + "]";
            r.mark(ik, ev[i]);
            r.get(ev[i], ik, &s);
            ep.domain_sizes.push_back(s);
          }
        } else if (ek == "base_sync_every") {
          r.get(ev, efull, &ep.base_sync_every);
        } else if (ek == "base_codec") {
          r.get(ev, efull, &ep.base_codec);
        } else if (ek == "fused_encode") {
          r.get(ev, efull, &ep.fused_encode);
        } else if (ek == "tokens_once_per_worker") {
          // auto, or any YAML boolean (yaml-cpp's: True, yes, off, ...).
          bool once = false;
          if (ev.IsScalar() && ev.Scalar() == "auto")
            ep.tokens_once_per_worker = TokensOncePerWorker::kAuto;
          else if (ev.IsScalar() && YAML::convert<bool>::decode(ev, once))
            ep.tokens_once_per_worker = tokens_once_per_worker_of(once);
          else
            return r.fail(ev, efull, "expected auto, true or false");
        } else if (ek == "replica_weight_gradients") {
          std::string s;
          r.get(ev, efull, &s);
          if (!r.ok()) return;
          auto w = parse_replica_weight_gradients(s);
          if (!w) return r.fail(ev, efull, w.status().message());
          ep.replica_weight_gradients = *w;
        } else if (ek == "pipeline_degree") {
          if (ev.IsScalar() && ev.Scalar() == "auto") ep.pipeline_degree = 0;
          else r.get(ev, efull, &ep.pipeline_degree);
          if (r.ok() && ev.Scalar() != "auto" && ep.pipeline_degree < 1)
            r.fail(ev, efull, "must be auto or a chunk count of at least 1");
        } else if (ek == "backward_pipeline_degree") {
          if (ev.IsScalar() && ev.Scalar() == "auto") ep.backward_pipeline_degree = 0;
          else r.get(ev, efull, &ep.backward_pipeline_degree);
          if (r.ok() && ev.Scalar() != "auto" && ep.backward_pipeline_degree < 1)
            r.fail(ev, efull, "must be auto or a chunk count of at least 1");
        } else {
          r.get_unit(ev, efull, &ep.memory_cap_bytes, parse_byte_size);
        }
      });
    }
  });
  XD_RETURN_IF_ERROR(r.status());
  ExpertParallelSpec& ep = c.expert_parallel;
  if (ep.mode == EpMode::kHybrid && !domains_given)
    r.fail_at("cluster.expert_parallel.domain_sizes", "required for mode hybrid");
  if (ep.mode == EpMode::kEp || (!domains_given && levels_given))
    ep.domain_sizes.assign(c.levels.size(), 1);
  XD_RETURN_IF_ERROR(r.status());
  if (auto issue = first_issue(c)) {
    r.fail_at(issue->first, issue->second);
    return r.status();
  }
  return c;
}

}  // namespace xd
