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
//
// With `outer_sign` (the SR base's `base_codec: sign`), the outer stage
// instead keeps every member's partial as all members hold it: the first
// call exchanges them exactly (fp32); each later one sends each member's
// change since then as block_sign:1 of rows of 1024 (a sign bit per entry,
// a scale per row), every member adds every decoded change to its copy, and
// the sum of the copies in member order is the result, the same bits
// everywhere. What a message leaves out stays in the next change (error
// feedback), so the copies follow the partials. A non-finite change is sent
// as 0; after a failed call the copies are dropped and the next call is an
// exact exchange again.
// Blocking; call from one thread per rank.
#pragma once

#include <cstddef>
#include <vector>

#include "common/status.h"
#include "compression/codec.h"
#include "transport/communicator.h"

namespace xd::detail {

// Every outer member's partial as all members hold it; owned by the caller
// across calls, one per buffer that is reduced repeatedly.
struct SignDeltaState {
  std::vector<std::vector<float>> held;  // per outer member
};

struct DenseWirePrecision {
  bool inner_bf16 = false;  // the inner group's links
  bool outer_bf16 = false;  // the outer group's links
  SignDeltaState* outer_sign = nullptr;  // sign-coded changes across the outer group
};

// What one stage's bf16 casts cost and lost: the CPU seconds of the casts
// to bf16 (encode) and back (decode), and over the values this worker
// rounded to send, the rounding's squared error and their squared sum
// (NMSE = error / signal). With
// outer_sign: the sign coding's seconds, and the error of the copy the
// members hold of this worker's partial.
struct StageCast {
  CodecSeconds seconds;
  double error = 0, signal = 0;
  void add(const StageCast& o) { seconds += o.seconds, error += o.error, signal += o.signal; }
};
struct CastFigures {
  StageCast inner, outer;
};

// `figures`, when given, gains the call's casts (stages in fp32 add nothing).
Status dense_all_reduce(Communicator* inner, Communicator* outer, DenseWirePrecision precision,
                        const CollectiveTag& tag, float* data, size_t count, CastFigures* figures = nullptr);

}  // namespace xd::detail
