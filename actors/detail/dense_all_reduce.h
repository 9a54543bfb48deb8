// The dense-gradient all-reduce, in two stages like hierarchical_all_reduce
// (inside `inner`, then across `outer`, then back inside `inner`), with the
// wire precision chosen per stage: fp32, or bf16 with fp32 sums (MegaScale-MoE
// Sec. 5): partial sums cross in bf16 (a reduce-scatter by one all-to-all),
// each shard is summed in fp32 by its owner, rounded to bf16 once and
// all-gathered. Every rank therefore ends with the same bits either way.
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
