// The dense-gradient all-reduce, in two stages like hierarchical_all_reduce
// (inside `inner`, then across `outer`, then back inside `inner`), with the
// wire precision chosen per stage: fp32, or bf16 with fp32 sums (MegaScale-MoE
// Sec. 5): partial sums cross in bf16 (a reduce-scatter by one all-to-all),
// each shard is summed in fp32 by its owner, rounded to bf16 once and
// all-gathered. A group for which Communicator::one_shot_all_reduce() holds
// (two members up to 16 MB, or a small buffer) instead runs one round: every member's
// buffer goes to every other (in bf16: rounded, the own one too) and each
// sums them in member order in fp32. With one member across, the inner group
// does so for the whole buffer. Every rank therefore ends with the same bits
// either way.
// Blocking; call from one thread per rank.
#pragma once

#include <cstddef>

#include "common/status.h"
#include "transport/communicator.h"

namespace xd::detail {

struct DenseWirePrecision {
  bool inner_bf16 = false;  // the inner group's links
  bool outer_bf16 = false;  // the outer group's links
};

Status dense_all_reduce(Communicator* inner, Communicator* outer, DenseWirePrecision precision,
                        const CollectiveTag& tag, float* data, size_t count);

}  // namespace xd::detail
