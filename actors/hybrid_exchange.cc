#include "actors/hybrid_exchange.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "actors/detail/exchange_route.h"
#include "actors/detail/row_order.h"
#include "actors/detail/work_thread.h"
#include "common/clock.h"
#include "common/log.h"

namespace xd {

namespace {
bool is_backward(const ExchangeTag& tag) {
  return tag.phase == (int)ExchangePhase::kCombineBackward || tag.phase == (int)ExchangePhase::kDispatchBackward;
}
// Trace names by ExchangePhase: the transfer (a comm lane), and the compute
// thread's wait for it.
constexpr const char* kTransferNames[] = {"dispatch", "combine", "combine backward", "dispatch backward"};
constexpr const char* kWaitNames[] = {"wait dispatch", "wait combine", "wait combine backward",
                                      "wait dispatch backward"};
}  // namespace

HybridExpertExchange::HybridExpertExchange(Transport* transport, Topology topology, int num_experts,
                                           std::chrono::milliseconds timeout)
    : transport_(transport),
      topology_(std::move(topology)),
      rank_(transport->rank()),
      num_experts_(num_experts),
      experts_per_worker_(num_experts / topology_.world_size()),
      computed_index_(num_experts, -1),
      timeout_(timeout) {
  XD_CHECK(num_experts % topology_.world_size() == 0);
  // Experts of every worker whose location shares this worker's domain at
  // every level: owned, or gathered at some level.
  for (int m = 0; m < topology_.world_size(); ++m) {
    bool same = true;
    for (int l = 0; l < topology_.num_levels(); ++l)
      same &= topology_.domain(m, l) == topology_.domain(rank_, l);
    if (!same) continue;
    for (int j = 0; j < experts_per_worker_; ++j) computed_.push_back(m * experts_per_worker_ + j);
  }
  std::sort(computed_.begin(), computed_.end());
  for (size_t i = 0; i < computed_.size(); ++i) computed_index_[computed_[i]] = static_cast<int>(i);
  figures_.assign(topology_.world_size(), TokenCodecFigures{});
  peak_bytes_.assign(topology_.num_levels(), 0.0);
  for (int l = 0; l < topology_.num_levels(); ++l) local_only_ = local_only_ && topology_.a2a_peers(rank_, l).empty();
  // Where each owner's rows go at each level's Dispatch hop: fixed with the
  // topology, looked up per row.
  dispatch_member_.assign(topology_.num_levels(), std::vector<int>(topology_.world_size()));
  for (int l = 0; l < topology_.num_levels(); ++l)
    for (int owner = 0; owner < topology_.world_size(); ++owner)
      dispatch_member_[l][owner] = topology_.dispatch_coordinate(rank_, l, owner);
  set_overlapped(true);
}

// Dispatch's walk through the levels, outermost first (dispatch_hop).
int HybridExpertExchange::destination_of(int expert) const {
  int at = rank_;
  const int owner = owner_of(expert);
  for (int l = 0; l < topology_.num_levels(); ++l)
    at = topology_.with_coordinate(at, l, topology_.dispatch_coordinate(at, l, owner));
  return at;
}

HybridExpertExchange::~HybridExpertExchange() {
  to_experts_thread_.reset();
  to_sources_thread_.reset();
}

void HybridExpertExchange::set_overlapped(bool overlapped) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    XD_CHECK_MSG(results_.empty(), "set_overlapped with exchanges in flight");
  }
  XD_CHECK_MSG(direct_passes_.empty(), "set_overlapped with exchanges in flight");
  if (overlapped && !to_experts_thread_) {
    to_experts_thread_ = std::make_unique<detail::WorkThread>("to-experts");
    to_sources_thread_ = std::make_unique<detail::WorkThread>("to-sources");
  } else if (!overlapped) {
    to_experts_thread_.reset();
    to_sources_thread_.reset();
  }
  update_direct();
}

void HybridExpertExchange::set_codecs(std::vector<CodecPipeline> to_experts, std::vector<CodecPipeline> to_sources) {
  XD_CHECK(to_experts.size() == static_cast<size_t>(topology_.world_size()) && to_sources.size() == to_experts.size());
  codec_to_experts_ = std::move(to_experts);
  codec_to_sources_ = std::move(to_sources);
  update_direct();
}

std::vector<TokenCodecFigures> HybridExpertExchange::take_token_figures() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TokenCodecFigures> out = figures_;
  std::fill(figures_.begin(), figures_.end(), TokenCodecFigures{});
  return out;
}

void HybridExpertExchange::set_peer_link_classes(std::vector<int> class_of_peer, int classes) {
  XD_CHECK(static_cast<int>(class_of_peer.size()) == topology_.world_size() && classes > 0);
  std::lock_guard<std::mutex> lock(mu_);
  peer_class_ = std::move(class_of_peer);
  peak_bytes_.assign(classes, 0.0);
}

std::vector<double> HybridExpertExchange::take_peak_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<double> out = peak_bytes_;
  std::fill(peak_bytes_.begin(), peak_bytes_.end(), 0.0);
  return out;
}

std::array<double, 2> HybridExpertExchange::take_blocked_seconds() {
  const std::array<double, 2> s = blocked_s_;
  blocked_s_ = {0.0, 0.0};
  return s;
}

Status HybridExpertExchange::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

void HybridExpertExchange::fail(const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_.is_ok()) status_ = st;
}

// The wire chunk field holds the pipeline chunk and the level: a chunk's
// hops never match another chunk's or level's messages.
Tag HybridExpertExchange::wire_tag(const ExchangeTag& t, bool forward_path, int level, uint32_t step) const {
  return Tag{forward_path ? MessageKind::kMoeDispatch : MessageKind::kMoeCombine, step,
             static_cast<uint16_t>(t.layer), static_cast<uint16_t>(t.phase),
             static_cast<uint32_t>(t.chunk) * 16 + static_cast<uint32_t>(level)};
}

HybridExpertExchange::Route& HybridExpertExchange::route(const ExchangeTag& tag) {
  std::unique_lock<std::mutex> lock(mu_);
  auto at = [this](int layer, int chunk, int span) -> Route& {
    std::unique_ptr<Route>& r = routes_[{layer, chunk, span}];
    if (!r) r = std::make_unique<Route>();
    return *r;
  };
  Route& r = at(tag.layer, tag.chunk, tag.span);
  // A span's backward of Combine comes after its chunks' Dispatches have
  // concluded (nothing writes their routes until the next step's), and its
  // backward of Dispatch follows the route it built; merged without the lock.
  if (tag.span > 1 && tag.phase == (int)ExchangePhase::kCombineBackward) {
    std::vector<const Route*> parts;
    for (int i = 0; i < tag.span; ++i) parts.push_back(&at(tag.layer, tag.chunk + i, 1));
    lock.unlock();
    r = detail::merge_routes(parts, topology_.num_levels());
  }
  return r;
}

void HybridExpertExchange::add_codec_seconds(int peer, int direction, CodecSeconds s) {
  std::lock_guard<std::mutex> lock(mu_);
  figures_[peer].codec[direction] += s;
}

void HybridExpertExchange::publish(const ExchangeTag& tag, Result result) {
  if (!result.status.is_ok()) fail(result.status);
  std::lock_guard<std::mutex> lock(mu_);
  results_[tag] = std::move(result);
  done_.notify_all();
}

HybridExpertExchange::Hop HybridExpertExchange::dispatch_hop(int l, const std::vector<int>& ids) const {
  const int members = topology_.level_sizes()[l];
  const std::vector<int>& to_member = dispatch_member_[l];
  std::vector<int> dest(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) dest[k] = to_member[owner_of(ids[k])];
  Hop hop;
  hop.send_order.resize(ids.size());
  std::iota(hop.send_order.begin(), hop.send_order.end(), 0);
  std::stable_sort(hop.send_order.begin(), hop.send_order.end(), [&](int a, int b) { return dest[a] < dest[b]; });
  hop.send_counts.assign(members, 0);
  for (int d : dest) hop.send_counts[d]++;
  return hop;
}

HybridExpertExchange::Pass HybridExpertExchange::begin_pass(const ExchangeTag& tag, std::vector<float> rows,
                                                            const std::vector<int>& counts, int width,
                                                            uint32_t step) {
  Pass p;
  p.tag = tag;
  p.step = step;
  p.width = width;
  p.to_experts = tag.phase == (int)ExchangePhase::kDispatch || tag.phase == (int)ExchangePhase::kCombineBackward;
  p.route = &route(tag);
  p.counts = counts;
  p.status = status();  // after a failure, only shapes are kept (conclude)
  p.started = steady_seconds();
  Route& r = *p.route;
  const size_t levels = topology_.num_levels();
  if (tag.phase == (int)ExchangePhase::kDispatch) {
    if (!p.status.is_ok()) return p;
    r = Route{};
    r.counts_in = counts;
    r.rows_in = std::accumulate(counts.begin(), counts.end(), 0);
    r.hops.reserve(levels);  // hops in flight point into it
    if (rows.size() != (size_t)r.rows_in * width)
      p.status = Status::internal("MoE exchange: rows do not match counts");
    for (int e = 0; e < (int)counts.size(); ++e) p.ids.insert(p.ids.end(), counts[e], e);
    p.data = std::move(rows);
  } else if (p.to_experts) {
    if (p.status.is_ok() && r.hops.size() != levels)
      p.status = Status::internal("MoE exchange: a backward exchange without its Dispatch");
    else if (p.status.is_ok() && counts != r.counts_in)
      p.status = Status::internal("MoE exchange: backward with other counts than the Dispatch");
    p.data = std::move(rows);
  } else {
    if (p.status.is_ok() && r.hops.size() != levels)
      p.status = Status::internal("MoE exchange: rows sent back without a Dispatch");
    if (p.status.is_ok() && rows.size() != r.final_order.size() * (size_t)width)
      p.status = Status::internal("MoE exchange: rows do not match the route");
    if (p.status.is_ok())
      p.data = detail::is_identity(r.final_order) ? std::move(rows)
                                                  : detail::rows_scattered(rows.data(), r.final_order, width);
    else p.data.assign(r.final_order.size() * (size_t)width, 0.0f);
  }
  return p;
}

bool HybridExpertExchange::networked(const HopInFlight& h) const {
  for (const auto& slot : h.slots)
    if (slot) return true;
  return false;
}

void HybridExpertExchange::advance(Pass* p, bool stop_after_send) {
  // One span per level's hop inside the exchange's span: a trace shows which
  // level's transfer takes the time (levels past the fourth are not named).
  static const char* const kHopNames[] = {"hop, level 0", "hop, level 1", "hop, level 2", "hop, level 3"};
  const int levels = topology_.num_levels();
  const bool dispatching = p->tag.phase == (int)ExchangePhase::kDispatch;
  while (p->status.is_ok() && p->levels_done < levels) {
    const int l = p->to_experts ? p->levels_done : levels - 1 - p->levels_done;
    auto h = std::make_unique<HopInFlight>();
    h->tag = wire_tag(p->tag, p->to_experts, l, p->step);
    h->level = l;
    if (dispatching) p->route->hops.push_back(dispatch_hop(l, p->ids));
    h->hop = &p->route->hops[l];
    h->forward = p->to_experts;
    h->discover = dispatching;
    h->width = p->width;
    h->sent_at = steady_seconds();
    std::vector<int>* ids = dispatching ? &p->ids : nullptr;
    p->status = send_hop(h.get(), &p->data, ids);
    ++p->levels_done;
    if (!p->status.is_ok()) break;
    if (stop_after_send && networked(*h)) {
      p->in_flight = std::move(h);
      return;
    }
    p->status = receive_hop(h.get(), &p->data, ids, true, nullptr);
    if (timeline_ && timeline_->enabled() && l < 4)
      timeline_->add(Span{kHopNames[l], p->tag.layer, p->to_experts ? Lane::kToExperts : Lane::kToSources, false,
                          h->sent_at, steady_seconds()});
  }
}

HybridExpertExchange::Result HybridExpertExchange::conclude(Pass* p) {
  Route& r = *p->route;
  const int width = p->width;
  const bool dispatching = p->tag.phase == (int)ExchangePhase::kDispatch;
  if (p->status.is_ok() && dispatching) {
    r.final_order.resize(p->ids.size());
    std::iota(r.final_order.begin(), r.final_order.end(), 0);
    for (int id : p->ids)
      if (computed_index_[id] < 0) p->status = Status::internal("a row reached a worker without its expert");
    if (p->status.is_ok()) {
      std::stable_sort(r.final_order.begin(), r.final_order.end(), [&](int a, int b) {
        return computed_index_[p->ids[a]] < computed_index_[p->ids[b]];
      });
      r.out_counts.assign(computed_.size(), 0);
      for (int id : p->ids) r.out_counts[computed_index_[id]]++;
    }
  }
  if (p->status.is_ok() && !p->to_experts && p->data.size() != (size_t)r.rows_in * width)
    p->status = Status::internal("MoE exchange lost rows");
  Result result;
  result.status = p->status;
  if (!p->status.is_ok()) {
    // Keep shapes consistent so the math can finish; the trainer checks
    // status() and abandons the step.
    if (dispatching) {
      // This call's route, so its Combine returns as many rows as were sent.
      r = Route{};
      r.counts_in = p->counts;
      r.rows_in = std::accumulate(p->counts.begin(), p->counts.end(), 0);
      r.out_counts.assign(computed_.size(), 0);
    }
    // Toward the experts as many rows as the counts say (a merged route with
    // a failed chunk has counts but no final order).
    const size_t rows_out = std::accumulate(r.out_counts.begin(), r.out_counts.end(), size_t{0});
    result.rows.assign((p->to_experts ? rows_out : (size_t)r.rows_in) * width, 0.0f);
  } else if (p->to_experts) {
    result.rows = detail::is_identity(r.final_order) ? std::move(p->data)
                                                     : detail::rows_gathered(p->data.data(), r.final_order, width);
  } else {
    result.rows = std::move(p->data);
  }
  if (p->to_experts) result.counts = r.out_counts;
  return result;
}

void HybridExpertExchange::run_to_experts(const ExchangeTag& tag, std::vector<float> rows,
                                          const std::vector<int>& counts, int width, uint32_t step) {
  ScopedSpan span(timeline_, kTransferNames[tag.phase & 3], tag.layer, Lane::kToExperts);
  Pass p = begin_pass(tag, std::move(rows), counts, width, step);
  advance(&p, false);
  publish(tag, conclude(&p));
}

void HybridExpertExchange::run_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width, uint32_t step) {
  ScopedSpan span(timeline_, kTransferNames[tag.phase & 3], tag.layer, Lane::kToSources);
  Pass p = begin_pass(tag, std::move(rows), {}, width, step);
  advance(&p, false);
  publish(tag, conclude(&p));
}


// Not overlapped, the whole exchange runs on the compute thread: all of it is
// compute waiting for communication.
template <typename F>
void HybridExpertExchange::run_inline(const ExchangeTag& tag, F run) {
  const double start = steady_seconds();
  run();
  blocked_s_[is_backward(tag) ? 1 : 0] += steady_seconds() - start;
}

HybridExpertExchange::Result HybridExpertExchange::wait_result(const ExchangeTag& tag) {
  const double start = steady_seconds();
  Result result;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return results_.count(tag) > 0; });
    auto it = results_.find(tag);
    result = std::move(it->second);
    results_.erase(it);
  }
  const double end = steady_seconds();
  note_wait(tag, end - start, start, end);
  return result;
}

void HybridExpertExchange::note_wait(const ExchangeTag& tag, double seconds, double from, double until) {
  blocked_s_[is_backward(tag) ? 1 : 0] += seconds;
  if (until > from && timeline_ && timeline_->enabled())
    timeline_->add(Span{kWaitNames[tag.phase & 3], tag.layer, Lane::kCompute, true, from, until});
}

void HybridExpertExchange::start_to_experts(const ExchangeTag& tag, std::vector<float> rows,
                                            const std::vector<int>& counts, int width) {
  const uint32_t step = step_;
  if (direct_) return start_direct(tag, std::move(rows), counts, width);
  if (!to_experts_thread_ || local_only_)
    return run_inline(tag, [&] { run_to_experts(tag, std::move(rows), counts, width, step); });
  auto shared_rows = std::make_shared<std::vector<float>>(std::move(rows));
  to_experts_thread_->post([this, tag, shared_rows, counts, width, step] {
    run_to_experts(tag, std::move(*shared_rows), counts, width, step);
  });
}

void HybridExpertExchange::finish_to_experts(const ExchangeTag& tag, std::vector<float>* out,
                                             std::vector<int>* out_counts) {
  Result r = direct_ ? finish_direct(tag) : wait_result(tag);
  *out = std::move(r.rows);
  *out_counts = std::move(r.counts);
}

void HybridExpertExchange::start_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width) {
  const uint32_t step = step_;
  if (direct_) return start_direct(tag, std::move(rows), {}, width);
  if (!to_sources_thread_ || local_only_)
    return run_inline(tag, [&] { run_to_sources(tag, std::move(rows), width, step); });
  auto shared_rows = std::make_shared<std::vector<float>>(std::move(rows));
  to_sources_thread_->post([this, tag, shared_rows, width, step] {
    run_to_sources(tag, std::move(*shared_rows), width, step);
  });
}

void HybridExpertExchange::finish_to_sources(const ExchangeTag& tag, std::vector<float>* out) {
  *out = std::move((direct_ ? finish_direct(tag) : wait_result(tag)).rows);
}

bool HybridExpertExchange::landed(const ExchangeTag& tag) const {
  if (direct_) {
    auto it = direct_passes_.find(tag);
    return it == direct_passes_.end() || !it->second.in_flight || hop_landed(*it->second.in_flight);
  }
  std::lock_guard<std::mutex> lock(mu_);
  return results_.count(tag) > 0;
}

// With one level of all-to-all peers and raw rows, an exchange needs no comm
// thread: start_* stages and queues its messages (the transport's thread
// paces them), finish_* takes what arrived. The next chunk's messages queue
// behind this one's at once, so the link never idles while a comm thread
// waits for a peer's chunk or for a core, and a transfer that has landed
// costs the compute thread no hand-off. Hops on levels without peers run
// locally on either side of it.
void HybridExpertExchange::update_direct() {
  int networked_levels = 0;
  for (int l = 0; l < topology_.num_levels(); ++l) networked_levels += !topology_.a2a_peers(rank_, l).empty();
  bool raw = true;
  for (const auto* codecs : {&codec_to_experts_, &codec_to_sources_})
    for (const CodecPipeline& c : *codecs) raw = raw && c.is_raw();
  direct_ = to_experts_thread_ && networked_levels == 1 && raw;  // overlapped
}

void HybridExpertExchange::start_direct(const ExchangeTag& tag, std::vector<float> rows,
                                        const std::vector<int>& counts, int width) {
  Pass p = begin_pass(tag, std::move(rows), counts, width, step_);
  advance(&p, true);
  XD_CHECK_MSG(direct_passes_.count(tag) == 0, "an exchange tag started twice");
  direct_passes_.emplace(tag, std::move(p));
}

HybridExpertExchange::Result HybridExpertExchange::finish_direct(const ExchangeTag& tag) {
  auto it = direct_passes_.find(tag);
  XD_CHECK_MSG(it != direct_passes_.end(), "finish of an exchange that was not started");
  Pass p = std::move(it->second);
  direct_passes_.erase(it);
  HopWait waited;
  if (p.in_flight) {
    HopInFlight& h = *p.in_flight;
    const bool dispatching = tag.phase == (int)ExchangePhase::kDispatch;
    p.status = receive_hop(&h, &p.data, dispatching ? &p.ids : nullptr, false, &waited);
    // This worker's own messages may still be on their way; the step's end
    // checks them (complete_sends), so compute never waits for its own sends.
    direct_sends_.insert(direct_sends_.end(), h.sends.begin(), h.sends.end());
    p.in_flight.reset();
    advance(&p, false);
  }
  Result result = conclude(&p);
  if (!result.status.is_ok()) fail(result.status);
  note_wait(tag, waited.seconds, waited.from, waited.until);
  if (timeline_ && timeline_->enabled())
    timeline_->add(Span{kTransferNames[tag.phase & 3], tag.layer, p.to_experts ? Lane::kToExperts : Lane::kToSources,
                        false, p.started, steady_seconds()});
  return result;
}

void HybridExpertExchange::complete_sends() {
  // After a failure the step was abandoned; a dead peer's sends may never
  // complete, and the failure is already reported.
  if (!status().is_ok()) direct_sends_.clear();
  for (const auto& c : direct_sends_) {
    Status st = c->wait(timeout_);
    if (!st.is_ok()) fail(st.with_context("MoE exchange: sending rows"));
  }
  direct_sends_.clear();
}

}  // namespace xd
