// The route of one MoE exchange through the levels (HybridExpertExchange):
// what each level's all-to-all sends where, learnt by the Dispatch of a layer
// and pipeline chunk and followed by its Combine and both backward
// exchanges. Plain values; merge_routes builds the route of a backward
// exchange that carries several forward chunks at once. Pure functions.
#pragma once

#include <vector>

namespace xd::detail {

// Rows before a hop are in the layout the previous hop left (the caller's
// rows before the first); after it they are grouped by level-group member in
// coordinate order, recv_counts[i] from member i (own kept rows at its own
// coordinate).
struct ExchangeHop {
  std::vector<int> send_order;   // row indices in the order sent (grouped by member)
  std::vector<int> send_counts;  // per level-group member (coordinate order)
  std::vector<int> recv_counts;  // per member; own kept rows at own coordinate
};

struct ExchangeRoute {
  int rows_in = 0;                 // plan rows at the source
  std::vector<ExchangeHop> hops;   // one per level
  std::vector<int> final_order;    // rows after the last hop, grouped by computed expert
  std::vector<int> out_counts;     // per computed expert
  std::vector<int> counts_in;      // the Dispatch counts, to check the backward
};

// The route of the parts' rows sent as one exchange: the rows come in part
// after part; to each member a hop sends the parts' rows for it one part
// after the other, so after the hop the rows from member i hold part after
// part too, as the members' merged routes expect; at the end they are
// grouped by computed expert and within an expert by part. counts_in, rows_in
// and out_counts are the parts' joined; hops and final_order only when every
// part has `levels` hops and a whole final order (a failed Dispatch leaves
// none), so a missing part shows as a route without hops.
ExchangeRoute merge_routes(const std::vector<const ExchangeRoute*>& parts, int levels);

}  // namespace xd::detail
