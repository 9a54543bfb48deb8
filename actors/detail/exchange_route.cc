#include "actors/detail/exchange_route.h"

#include <numeric>

#include "common/check.h"

namespace xd::detail {

namespace {

// Where part p's row k of a member-grouped layout lands in the merged one,
// for every part: the member's block, then the earlier parts' rows from it.
std::vector<std::vector<int>> merged_positions(const std::vector<const ExchangeRoute*>& parts, int level) {
  const size_t members = parts[0]->hops[level].recv_counts.size();
  std::vector<std::vector<int>> pos(parts.size());
  int at = 0;
  std::vector<std::vector<int>> first(parts.size(), std::vector<int>(members));
  for (size_t i = 0; i < members; ++i)
    for (size_t p = 0; p < parts.size(); ++p) {
      first[p][i] = at;
      at += parts[p]->hops[level].recv_counts[i];
    }
  for (size_t p = 0; p < parts.size(); ++p)
    for (size_t i = 0; i < members; ++i)
      for (int k = 0; k < parts[p]->hops[level].recv_counts[i]; ++k) pos[p].push_back(first[p][i] + k);
  return pos;
}

}  // namespace

ExchangeRoute merge_routes(const std::vector<const ExchangeRoute*>& parts, int levels) {
  XD_CHECK(!parts.empty());
  ExchangeRoute merged;
  bool whole = true;
  for (const ExchangeRoute* r : parts) {
    merged.rows_in += r->rows_in;
    merged.counts_in.insert(merged.counts_in.end(), r->counts_in.begin(), r->counts_in.end());
    if (merged.out_counts.empty()) merged.out_counts.assign(r->out_counts.size(), 0);
    XD_CHECK(r->out_counts.size() == merged.out_counts.size());
    for (size_t j = 0; j < r->out_counts.size(); ++j) merged.out_counts[j] += r->out_counts[j];
    whole = whole && r->hops.size() == (size_t)levels &&
            r->final_order.size() == (size_t)std::accumulate(r->out_counts.begin(), r->out_counts.end(), 0);
  }
  if (!whole) return merged;

  // Before the first hop the parts' rows come one part after the other.
  std::vector<std::vector<int>> pos(parts.size());
  for (size_t p = 0, at = 0; p < parts.size(); ++p)
    for (int k = 0; k < parts[p]->rows_in; ++k) pos[p].push_back(static_cast<int>(at++));
  merged.hops.resize(levels);
  for (int l = 0; l < levels; ++l) {
    ExchangeHop& hop = merged.hops[l];
    const size_t members = parts[0]->hops[l].send_counts.size();
    hop.send_counts.assign(members, 0);
    hop.recv_counts.assign(members, 0);
    std::vector<int> sent(parts.size(), 0);  // each part's send_order walked so far
    for (size_t i = 0; i < members; ++i)
      for (size_t p = 0; p < parts.size(); ++p) {
        const ExchangeHop& h = parts[p]->hops[l];
        XD_CHECK(h.send_counts.size() == members && h.recv_counts.size() == members);
        for (int k = 0; k < h.send_counts[i]; ++k) hop.send_order.push_back(pos[p][h.send_order[sent[p]++]]);
        hop.send_counts[i] += h.send_counts[i];
        hop.recv_counts[i] += h.recv_counts[i];
      }
    pos = merged_positions(parts, l);
  }
  // Grouped by computed expert, part after part within each.
  std::vector<int> taken(parts.size(), 0);
  for (size_t j = 0; j < merged.out_counts.size(); ++j)
    for (size_t p = 0; p < parts.size(); ++p)
      for (int k = 0; k < parts[p]->out_counts[j]; ++k)
        merged.final_order.push_back(pos[p][parts[p]->final_order[taken[p]++]]);
  return merged;
}

}  // namespace xd::detail
