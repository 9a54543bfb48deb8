// The planner's links (coordinator/detail/step_timeline.h): a link as a
// queue of transfers in wall time, a transfer as a route of hops, and the
// pair of egresses an uneven token A2A runs on. Values, no sharing; each
// StepTimeline owns its own.
#pragma once

#include <algorithm>
#include <iterator>
#include <map>
#include <vector>

namespace xd::detail {

// A link's egress as the runtime's token bucket runs it, one transfer after
// another. A transfer released at `at` takes the first gap from then on that
// holds it (transfers are priced route by route, so a later hop may be
// placed before an earlier-released one's), holds the link for `busy`
// seconds and lands `alpha` after its last byte left: the latencies of
// transfers queued behind each other overlap.
class LinkQueue {
 public:
  double send(double at, double busy, double alpha) {
    double start = at;
    auto it = busy_.upper_bound(start);
    if (it != busy_.begin() && std::prev(it)->second > start) start = std::prev(it)->second;
    for (; it != busy_.end() && it->first < start + busy; ++it) start = std::max(start, it->second);
    if (busy > 0) busy_.emplace(start, start + busy);
    return start + busy + alpha;
  }

 private:
  std::map<double, double> busy_;  // [start, end) of each transfer, disjoint
};

// One hop of a transfer: the link of `level` busy for `busy` seconds (bytes
// over its rate, and codec time), then `alpha` (its rounds' latency).
// A token A2A's hop is uneven (the routing's imbalance F): of a pair of
// peers, one sends F times the mean rows and the other 2 - F times, and the
// hop lands when the larger side has. `first` and `second` are the shares
// of the pair's two egresses: (F, 2 - F) toward the experts, and (2 - F, F)
// back to the sources, since the rows return the way they came. Everything
// else is even (1, 1).
struct Hop {
  int level = 0;
  double busy = 0, alpha = 0;
  double first = 1, second = 1;
  double longest() const { return busy * std::max(first, second); }
};
using Route = std::vector<Hop>;  // the hops of one transfer, in order

inline double total(const Route& route) {
  double s = 0;
  for (const Hop& h : route) s += h.longest() + h.alpha;
  return s;
}

// The egresses on one level of a pair of peers: the planner prices one
// worker, but with uneven routing its hops run as long as the peer's side,
// and a pipelined Combine queues on the peer's egress, not behind this
// worker's heavier Dispatch.
struct LinkPair {
  LinkQueue first, second;
  double send(double at, const Hop& h) {
    return std::max(first.send(at, h.busy * h.first, h.alpha), second.send(at, h.busy * h.second, h.alpha));
  }
};

}  // namespace xd::detail
