#include "actors/detail/gradient_buckets.h"

#include <algorithm>

#include "actors/detail/work_thread.h"
#include "common/check.h"
#include "common/clock.h"

namespace xd::detail {

GradientBuckets::GradientBuckets(Communicator* inner, Communicator* outer, DenseWirePrecision precision,
                                 std::vector<Ranges> buckets, bool overlapped, Timeline* timeline)
    : inner_(inner), outer_(outer), precision_(precision), timeline_(timeline) {
  XD_CHECK(!buckets.empty());
  buckets_.resize(buckets.size());
  step_of_.assign(buckets.size(), UINT32_MAX);  // no step yet
  for (size_t b = 0; b < buckets.size(); ++b) {
    size_t n = 0;
    for (auto [begin, end] : buckets[b]) n += end - begin;
    buckets_[b].ranges = std::move(buckets[b]);
    buckets_[b].buffer.resize(n);
    buckets_[b].done = true;
  }
  if (overlapped)
    for (int i = 0; i < std::min<int>(kThreads, num_buckets()); ++i)
      threads_.push_back(std::make_unique<WorkThread>("dense-allreduce"));
}

GradientBuckets::~GradientBuckets() { threads_.clear(); }

Status GradientBuckets::reduce(uint32_t step, int b) {
  ScopedSpan span(timeline_, "dense all-reduce", b, Lane::kDense);
  std::vector<float>& buffer = buckets_[b].buffer;
  if ((inner_->size() <= 1 && outer_->size() <= 1) || buffer.empty()) return Status::ok();
  // The layer field of the tag tells the buckets of one step apart.
  CastFigures cast;
  Status st = dense_all_reduce(inner_, outer_, precision_, CollectiveTag(step, static_cast<uint16_t>(b), 1),
                               buffer.data(), buffer.size(), &cast);
  std::lock_guard<std::mutex> lock(mu_);
  cast_.inner.add(cast.inner);
  cast_.outer.add(cast.outer);
  return st;
}

CastFigures GradientBuckets::take_cast_figures() {
  std::lock_guard<std::mutex> lock(mu_);
  CastFigures out = cast_;
  cast_ = CastFigures{};
  return out;
}

void GradientBuckets::start(uint32_t step, int b, const float* grads) {
  XD_CHECK(b >= 0 && b < num_buckets());
  Bucket& bucket = buckets_[b];
  {
    std::lock_guard<std::mutex> lock(mu_);
    XD_CHECK_MSG(bucket.done, "a gradient bucket started twice in one step");
    bucket.done = false;
  }
  size_t k = 0;
  for (auto [begin, end] : bucket.ranges) {
    std::copy(grads + begin, grads + end, bucket.buffer.begin() + k);
    k += end - begin;
  }
  step_of_[b] = step;
  if (threads_.empty()) return;  // finish() reduces
  threads_[b % threads_.size()]->post([this, step, b] {
    Status st = reduce(step, b);
    std::lock_guard<std::mutex> lock(mu_);
    buckets_[b].status = st;
    buckets_[b].done = true;
    cv_.notify_all();
  });
}

Status GradientBuckets::finish(uint32_t step, float* grads, float scale) {
  Status first;
  const double t0 = steady_seconds();
  for (int b = 0; b < num_buckets(); ++b) {
    Bucket& bucket = buckets_[b];
    XD_CHECK_MSG(step_of_[b] == step, "a gradient bucket was not started this step");
    if (threads_.empty()) {
      bucket.status = reduce(step_of_[b], b);
      bucket.done = true;
    } else {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return bucket.done; });
    }
    if (!bucket.status.is_ok() && first.is_ok()) first = bucket.status;
  }
  wait_s_ += steady_seconds() - t0;
  if (timeline_ && !threads_.empty()) timeline_->add(Span{"wait dense all-reduce", -1, Lane::kCompute, true, t0, steady_seconds()});
  XD_RETURN_IF_ERROR(first);
  for (int b = 0; b < num_buckets(); ++b) {
    Bucket& bucket = buckets_[b];
    size_t k = 0;
    for (auto [begin, end] : bucket.ranges)
      for (size_t i = begin; i < end; ++i) grads[i] = bucket.buffer[k++] * scale;
  }
  return Status::ok();
}

double GradientBuckets::take_wait_seconds() {
  const double s = wait_s_;
  wait_s_ = 0;
  return s;
}

}  // namespace xd::detail
