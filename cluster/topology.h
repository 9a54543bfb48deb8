// Topology: the HybridEP communication topology of G workers on L levels
// (HybridEP Sec. IV-A; docs/planner.md, "Topology").
//   * level sizes SF^0..SF^{L-1}, outermost first; G = prod SF^l;
//   * location(m) = (x_0..x_{L-1}), x_i = floor(m / prod_{j>i} SF^j) mod SF^i (Eq. 13);
//   * domain sizes S^l dividing SF^l; domain(m, l) = x_l / S^l, offset(m, l) = x_l mod S^l;
//   * pair rule (stricter than Algorithm 1): m and n communicate at level l only
//     when their locations differ in coordinate l alone. Same level-l domain:
//     all-gather of experts (AG). Different domains at the same offset:
//     all-to-all of tokens (A2A). Anything else: none.
// So every level's traffic stays on that level's link class. Immutable after
// construction; all queries are const and thread-safe.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace xd {

enum class PairType : int { kNone = 0, kAllGather = 1, kAllToAll = 2 };
const char* pair_type_name(PairType t);  // "none", "AG", "A2A"

struct TopologyPair {
  int m = 0, n = 0;  // ordered: m sends to n
  int level = 0;
  PairType type = PairType::kNone;
  bool operator==(const TopologyPair&) const = default;
};

struct PairCounts {
  long long ag = 0;   // ordered AG pairs
  long long a2a = 0;  // ordered A2A pairs
};

class Topology {
 public:
  // Errors: no levels, a level size < 1, a domain size not dividing its level
  // size, a count mismatch, or more than 65535 workers.
  static Status check(const std::vector<int>& level_sizes, const std::vector<int>& domain_sizes);
  static Expected<Topology> create(std::vector<int> level_sizes, std::vector<int> domain_sizes);
  // Same, for arguments known to be valid (XD_CHECKs check()).
  Topology(std::vector<int> level_sizes, std::vector<int> domain_sizes);

  int num_levels() const { return static_cast<int>(level_sizes_.size()); }
  int world_size() const { return world_size_; }
  const std::vector<int>& level_sizes() const { return level_sizes_; }
  const std::vector<int>& domain_sizes() const { return domain_sizes_; }

  std::vector<int> location(int m) const;            // Eq. 13
  int coordinate(int m, int l) const;                 // location(m)[l]
  int rank_of(const std::vector<int>& location) const;  // the inverse of location()
  int domain(int m, int l) const;                     // x_l / S^l
  int offset(int m, int l) const;                     // x_l mod S^l
  // m with coordinate l replaced by x.
  int with_coordinate(int m, int l, int x) const;
  // Dispatch's rule at level l for a token row at m whose expert `owner`
  // owns: the level-l coordinate the row moves to. m's own when the owner is
  // in m's level-l domain (that level gathered the expert), else m's offset
  // in the owner's domain (an A2A peer).
  int dispatch_coordinate(int m, int l, int owner) const;

  PairType pair_type(int m, int n, int l) const;
  // Every ordered pair (m, n, level, type) with type != none, by m, then level, then n.
  std::vector<TopologyPair> pairs() const;
  PairCounts pair_counts(int l) const;

  // Ranks that differ from m in coordinate l only, m included, in coordinate
  // order: the SF^l members of m's level-l group.
  std::vector<int> level_group(int m, int l) const;
  // m's level-l expert domain without m, in coordinate order (S^l - 1 ranks).
  std::vector<int> ag_peers(int m, int l) const;
  // The ranks at m's offset in the other level-l domains, in coordinate order
  // (SF^l / S^l - 1 ranks).
  std::vector<int> a2a_peers(int m, int l) const;

  std::string describe() const;  // "levels [4, 8], domains [2, 4], G = 32"

 private:
  std::vector<int> level_sizes_, domain_sizes_;
  std::vector<int> strides_;  // prod_{j>l} SF^j
  int world_size_ = 1;
};

}  // namespace xd
