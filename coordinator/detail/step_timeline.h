// The planner's step timeline for one candidate at one pair of pipeline
// degrees: the iteration as the compute stream, with every transfer
// crossing its levels' links as FIFO queues in wall time
// (coordinator/planner.h documents what it models). Pure functions, no
// state; safe from any thread.
#pragma once

#include <vector>

#include "coordinator/planner.h"

namespace xd::detail {

// The candidate `domain_sizes` at forward degree `r` and backward degree
// `rb` (a divisor of r), with the replicas' weight gradients `late` or not.
PlanCandidate evaluate_with_degree(const Workload& w, const std::vector<int>& level_sizes,
                                   const std::vector<LinkModel>& links, const std::vector<int>& domain_sizes,
                                   double memory_cap_bytes, const std::vector<LinkCodecCost>& link_codecs, int r,
                                   int rb, bool late);

}  // namespace xd::detail
