// Timeline: the spans one worker's threads record -- compute, waits on
// communication, transfers -- so a step can be drawn (a Chrome trace, a PNG)
// and its overlap seen. Recording is off by default and costs one relaxed
// atomic load then; when on, a span is a few words under one mutex (a step
// records a few hundred). Thread-safe. Times are steady_seconds().
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "common/clock.h"

namespace xd {

// Where a span ran: the compute thread, or one of the communication threads.
enum class Lane : int {
  kCompute = 0,
  kToExperts = 1,   // Dispatch and its backward's twin (rows toward the experts)
  kToSources = 2,   // Combine and the backward of Dispatch
  kExperts = 3,     // HybridEP expert all-gather, replica gradients, SR base
  kDense = 4,       // dense-gradient all-reduce buckets
  kLink = 5,        // a shaped link class's egress transmitting (Span::layer: the class)
};
const char* lane_name(Lane lane);

struct Span {
  const char* name = "";  // a string literal
  int layer = -1;         // -1: not a layer's
  Lane lane = Lane::kCompute;
  bool wait = false;      // the compute thread blocked on communication
  double start_s = 0, end_s = 0;
};

class Timeline {
 public:
  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void add(const Span& span) {
    if (!enabled()) return;
    std::lock_guard<std::mutex> lock(mu_);
    spans_.push_back(span);
  }
  std::vector<Span> take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Span> out;
    out.swap(spans_);
    return out;
  }

 private:
  std::atomic<bool> enabled_{false};
  std::mutex mu_;
  std::vector<Span> spans_;
};

// Records [construction, destruction) on `timeline` (may be null).
class ScopedSpan {
 public:
  ScopedSpan(Timeline* timeline, const char* name, int layer = -1, Lane lane = Lane::kCompute, bool wait = false)
      : timeline_(timeline && timeline->enabled() ? timeline : nullptr) {
    if (!timeline_) return;
    span_ = Span{name, layer, lane, wait, steady_seconds(), 0};
  }
  ~ScopedSpan() {
    if (!timeline_) return;
    span_.end_s = steady_seconds();
    timeline_->add(span_);
  }
  ScopedSpan(const ScopedSpan&) = delete;
  ScopedSpan& operator=(const ScopedSpan&) = delete;

 private:
  Timeline* timeline_;
  Span span_;
};

inline const char* lane_name(Lane lane) {
  switch (lane) {
    case Lane::kCompute: return "compute";
    case Lane::kToExperts: return "to experts";
    case Lane::kToSources: return "to sources";
    case Lane::kExperts: return "expert gather / grads";
    case Lane::kDense: return "dense all-reduce";
    case Lane::kLink: return "link egress";
  }
  return "?";
}

}  // namespace xd
