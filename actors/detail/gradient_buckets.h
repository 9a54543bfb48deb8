// GradientBuckets: the dense-gradient all-reduce in buckets (FSMoE Sec. 5).
// The replicated gradients are cut into buckets along the order backward
// finishes them (LM head, last layer ... first layer, embedding); each bucket
// is copied out and all-reduced as soon as start() is called for it, on one
// of a few bucket threads (bucket b on thread b mod kThreads, the same on
// every worker, so collectives pair up), while backward goes on. Several
// buckets in flight pay a slow link's latency once, not once per bucket. finish() waits for all of them and
// writes the sums back. Not overlapped (set at construction), start() only
// copies and finish() reduces the same buckets in the same order on the
// caller's thread: the same messages and sums, nothing hidden.
// start()/finish() come from one thread (the compute thread).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "actors/detail/dense_all_reduce.h"
#include "common/status.h"
#include "common/timeline.h"
#include "model/param_layout.h"
#include "transport/communicator.h"

namespace xd::detail {

class WorkThread;

class GradientBuckets {
 public:
  using Ranges = std::vector<std::pair<size_t, size_t>>;  // [begin, end) in the gradient block

  // `buckets[b]` lists bucket b's ranges.
  GradientBuckets(Communicator* inner, Communicator* outer, DenseWirePrecision precision,
                  std::vector<Ranges> buckets, bool overlapped, Timeline* timeline);
  ~GradientBuckets();

  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  const DenseWirePrecision& precision() const { return precision_; }
  // Copies bucket b out of `grads` and starts its all-reduce.
  void start(uint32_t step, int bucket, const float* grads);
  // Waits for every bucket of `step` (each must have been started for it), then
  // writes grads = sum * scale for every range. The first failure, or ok.
  Status finish(uint32_t step, float* grads, float scale);
  // Seconds finish() blocked since the last call.
  double take_wait_seconds();
  // The bf16 stages' casts since the last call (dense_all_reduce's figures).
  CastFigures take_cast_figures();

 private:
  struct Bucket {
    Ranges ranges;
    std::vector<float> buffer;
    bool done = false;
    Status status;
  };
  Status reduce(uint32_t step, int b);

  Communicator* inner_;
  Communicator* outer_;
  DenseWirePrecision precision_;
  Timeline* timeline_;
  std::vector<uint32_t> step_of_;  // per bucket, the step it was started for
  double wait_s_ = 0;
  std::mutex mu_;
  CastFigures cast_;  // under mu_
  std::condition_variable cv_;
  std::vector<Bucket> buckets_;
  static constexpr int kThreads = kDenseBucketThreads;
  std::vector<std::unique_ptr<WorkThread>> threads_;  // last: stopped first; empty when not overlapped
};

}  // namespace xd::detail
