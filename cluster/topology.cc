#include "cluster/topology.h"

#include <sstream>

namespace xd {

const char* pair_type_name(PairType t) {
  switch (t) {
    case PairType::kNone: return "none";
    case PairType::kAllGather: return "AG";
    case PairType::kAllToAll: return "A2A";
  }
  return "?";
}

Status Topology::check(const std::vector<int>& level_sizes, const std::vector<int>& domain_sizes) {
  if (level_sizes.empty()) return Status::invalid_argument("at least one level is required");
  if (domain_sizes.size() != level_sizes.size())
    return Status::invalid_argument("need one domain size per level: " +
                                    std::to_string(level_sizes.size()) + " levels, " +
                                    std::to_string(domain_sizes.size()) + " domain sizes");
  long long g = 1;
  for (size_t l = 0; l < level_sizes.size(); ++l) {
    const std::string at = "level " + std::to_string(l);
    if (level_sizes[l] < 1) return Status::invalid_argument(at + ": size must be at least 1");
    g *= level_sizes[l];
    if (g > 65535) return Status::invalid_argument("more than 65535 workers");
    if (domain_sizes[l] < 1) return Status::invalid_argument(at + ": domain size must be at least 1");
    if (level_sizes[l] % domain_sizes[l] != 0)
      return Status::invalid_argument(at + ": domain size " + std::to_string(domain_sizes[l]) +
                                      " does not divide the level size " +
                                      std::to_string(level_sizes[l]));
  }
  return Status::ok();
}

Expected<Topology> Topology::create(std::vector<int> level_sizes, std::vector<int> domain_sizes) {
  XD_RETURN_IF_ERROR(check(level_sizes, domain_sizes));
  return Topology(std::move(level_sizes), std::move(domain_sizes));
}

Topology::Topology(std::vector<int> level_sizes, std::vector<int> domain_sizes)
    : level_sizes_(std::move(level_sizes)), domain_sizes_(std::move(domain_sizes)) {
  XD_CHECK_MSG(check(level_sizes_, domain_sizes_).is_ok(),
               check(level_sizes_, domain_sizes_).message().c_str());
  strides_.assign(level_sizes_.size(), 1);
  for (int l = num_levels() - 2; l >= 0; --l) strides_[l] = strides_[l + 1] * level_sizes_[l + 1];
  world_size_ = strides_[0] * level_sizes_[0];
}

int Topology::coordinate(int m, int l) const {
  XD_CHECK(m >= 0 && m < world_size_ && l >= 0 && l < num_levels());
  return (m / strides_[l]) % level_sizes_[l];
}

std::vector<int> Topology::location(int m) const {
  std::vector<int> loc(level_sizes_.size());
  for (int l = 0; l < num_levels(); ++l) loc[l] = coordinate(m, l);
  return loc;
}

int Topology::rank_of(const std::vector<int>& loc) const {
  XD_CHECK(loc.size() == level_sizes_.size());
  int m = 0;
  for (int l = 0; l < num_levels(); ++l) {
    XD_CHECK(loc[l] >= 0 && loc[l] < level_sizes_[l]);
    m += loc[l] * strides_[l];
  }
  return m;
}

int Topology::with_coordinate(int m, int l, int x) const {
  XD_CHECK(x >= 0 && x < level_sizes_[l]);
  return m + (x - coordinate(m, l)) * strides_[l];
}

int Topology::dispatch_coordinate(int m, int l, int owner) const {
  const int owner_domain = domain(owner, l);
  return owner_domain == domain(m, l) ? coordinate(m, l) : owner_domain * domain_sizes_[l] + offset(m, l);
}

int Topology::domain(int m, int l) const { return coordinate(m, l) / domain_sizes_[l]; }
int Topology::offset(int m, int l) const { return coordinate(m, l) % domain_sizes_[l]; }

PairType Topology::pair_type(int m, int n, int l) const {
  XD_CHECK(n >= 0 && n < world_size_);
  const int xm = coordinate(m, l), xn = coordinate(n, l);
  if (xm == xn) return PairType::kNone;
  // The stricter rule: every other coordinate, outer ones included, must agree.
  if (with_coordinate(m, l, xn) != n) return PairType::kNone;
  const int s = domain_sizes_[l];
  if (xm / s == xn / s) return PairType::kAllGather;  // offsets differ since xm != xn
  if (xm % s == xn % s) return PairType::kAllToAll;
  return PairType::kNone;
}

std::vector<TopologyPair> Topology::pairs() const {
  std::vector<TopologyPair> out;
  for (int m = 0; m < world_size_; ++m)
    for (int l = 0; l < num_levels(); ++l)
      for (int n : level_group(m, l)) {
        const PairType t = pair_type(m, n, l);
        if (t != PairType::kNone) out.push_back({m, n, l, t});
      }
  return out;
}

PairCounts Topology::pair_counts(int l) const {
  XD_CHECK(l >= 0 && l < num_levels());
  PairCounts c;
  for (int m = 0; m < world_size_; ++m)
    for (int n : level_group(m, l)) {
      const PairType t = pair_type(m, n, l);
      if (t == PairType::kAllGather) ++c.ag;
      else if (t == PairType::kAllToAll) ++c.a2a;
    }
  return c;
}

std::vector<int> Topology::level_group(int m, int l) const {
  XD_CHECK(l >= 0 && l < num_levels());
  std::vector<int> g(level_sizes_[l]);
  for (int x = 0; x < level_sizes_[l]; ++x) g[x] = with_coordinate(m, l, x);
  return g;
}

std::vector<int> Topology::ag_peers(int m, int l) const {
  std::vector<int> out;
  const int s = domain_sizes_[l], first = domain(m, l) * s;
  for (int x = first; x < first + s; ++x)
    if (x != coordinate(m, l)) out.push_back(with_coordinate(m, l, x));
  return out;
}

std::vector<int> Topology::a2a_peers(int m, int l) const {
  std::vector<int> out;
  const int s = domain_sizes_[l], off = offset(m, l);
  for (int d = 0; d < level_sizes_[l] / s; ++d)
    if (d != domain(m, l)) out.push_back(with_coordinate(m, l, d * s + off));
  return out;
}

std::string Topology::describe() const {
  std::ostringstream os;
  auto list = [&](const std::vector<int>& v) {
    os << "[";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
    os << "]";
  };
  os << "levels ";
  list(level_sizes_);
  os << ", domains ";
  list(domain_sizes_);
  os << ", G = " << world_size_;
  return os.str();
}

}  // namespace xd
