#include "actors/hybrid_exchange.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "actors/detail/work_thread.h"
#include "common/clock.h"
#include "common/log.h"

namespace xd {

namespace {
// The most a peer's compressed rows may decode to: the transport's default
// cap on one message (TransportOptions::max_message_bytes).
constexpr uint64_t kMaxDecodedBytes = uint64_t(2) << 30;

// A frame over `count` elements of `buf` from `first`; it keeps the whole
// buffer alive until ZeroMQ has sent it, so the slices of one staged buffer go
// out without a copy per peer, and an early error return cannot free them.
template <typename T>
OutFrame slice_frame(const std::shared_ptr<std::vector<T>>& buf, size_t first, size_t count) {
  OutFrame f;
  f.data = buf->data() + first;
  f.size = count * sizeof(T);
  f.owner = std::shared_ptr<const void>(buf, buf->data());
  return f;
}
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
  raw_bytes_.assign(topology_.world_size(), {0.0, 0.0});
  peak_bytes_.assign(topology_.num_levels(), 0.0);
  for (int l = 0; l < topology_.num_levels(); ++l) local_only_ = local_only_ && topology_.a2a_peers(rank_, l).empty();
  set_overlapped(true);
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
  if (overlapped && !to_experts_thread_) {
    to_experts_thread_ = std::make_unique<detail::WorkThread>("to-experts");
    to_sources_thread_ = std::make_unique<detail::WorkThread>("to-sources");
  } else if (!overlapped) {
    to_experts_thread_.reset();
    to_sources_thread_.reset();
  }
}

void HybridExpertExchange::set_codecs(std::vector<CodecPipeline> to_experts, std::vector<CodecPipeline> to_sources) {
  XD_CHECK(to_experts.size() == static_cast<size_t>(topology_.world_size()) && to_sources.size() == to_experts.size());
  codec_to_experts_ = std::move(to_experts);
  codec_to_sources_ = std::move(to_sources);
}

double HybridExpertExchange::take_codec_seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  const double s = codec_s_;
  codec_s_ = 0;
  return s;
}

std::vector<std::array<double, 2>> HybridExpertExchange::take_raw_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::array<double, 2>> out = raw_bytes_;
  for (auto& b : raw_bytes_) b = {0.0, 0.0};
  return out;
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
  std::lock_guard<std::mutex> lock(mu_);
  return routes_[{tag.layer, tag.chunk}];
}

Status HybridExpertExchange::move(const Tag& tag, int level, Hop* hop, bool forward, bool discover,
                                  int width, std::vector<float>* data, std::vector<int>* ids) {
  // One span per level's hop inside the exchange's span: a trace shows which
  // level's transfer takes the time (levels past the fourth are not named).
  static const char* const kHopNames[] = {"hop, level 0", "hop, level 1", "hop, level 2", "hop, level 3"};
  ScopedSpan hop_span(level < 4 ? timeline_ : nullptr, level < 4 ? kHopNames[level] : "",
                      tag.layer == kNoLayer ? -1 : (int)tag.layer,
                      tag.kind == MessageKind::kMoeDispatch ? Lane::kToExperts : Lane::kToSources);
  const std::vector<int> group = topology_.level_group(rank_, level);
  const int me = topology_.coordinate(rank_, level);
  const int members = static_cast<int>(group.size());
  const std::vector<int>& out_counts = forward ? hop->send_counts : hop->recv_counts;
  std::vector<int> in_counts = forward ? hop->recv_counts : hop->send_counts;
  if (discover) in_counts.assign(members, 0);
  std::vector<int> out_off(members + 1, 0);
  for (int i = 0; i < members; ++i) out_off[i + 1] = out_off[i] + out_counts[i];

  // Outgoing rows grouped by member: forward permutes into send order, reverse
  // already holds the received layout.
  auto staged_buffer = std::make_shared<std::vector<float>>();
  auto staged_ids_buffer = std::make_shared<std::vector<int32_t>>();
  std::vector<float>& staged = *staged_buffer;
  std::vector<int32_t>& staged_ids = *staged_ids_buffer;
  if (forward) {
    staged.resize(hop->send_order.size() * (size_t)width);
    for (size_t k = 0; k < hop->send_order.size(); ++k)
      std::memcpy(&staged[k * width], &(*data)[(size_t)hop->send_order[k] * width], sizeof(float) * width);
    if (ids) {
      staged_ids.resize(hop->send_order.size());
      for (size_t k = 0; k < hop->send_order.size(); ++k) staged_ids[k] = (*ids)[hop->send_order[k]];
    }
  } else {
    staged = std::move(*data);
  }

  // Rows move only between A2A pairs of this level; every A2A peer gets a
  // message, empty or not, so nobody waits for a message that never comes.
  std::vector<std::shared_ptr<RecvSlot>> slots(members);
  for (int i = 0; i < members; ++i) {
    if (i == me) continue;
    if (topology_.pair_type(rank_, group[i], level) != PairType::kAllToAll) {
      XD_CHECK_MSG(out_counts[i] == 0, "a row was routed to a non-A2A peer");
      continue;
    }
    slots[i] = transport_->recv(group[i], tag);
  }
  const bool toward_experts = tag.kind == MessageKind::kMoeDispatch;
  const std::vector<CodecPipeline>& codecs = toward_experts ? codec_to_experts_ : codec_to_sources_;
  std::vector<std::shared_ptr<Completion>> sends;
  for (int i = 0; i < members; ++i) {
    if (!slots[i]) continue;
    const size_t rows = out_counts[i];
    {
      std::lock_guard<std::mutex> lock(mu_);
      raw_bytes_[group[i]][toward_experts ? 0 : 1] += double(rows) * width * sizeof(float);
    }
    std::vector<OutFrame> frames;
    if (ids) frames.push_back(slice_frame(staged_ids_buffer, out_off[i], out_counts[i]));
    const CodecPipeline* codec = codecs.empty() ? nullptr : &codecs[group[i]];
    if (codec && !codec->is_raw()) {
      auto encoded = std::make_shared<EncodedTensor>();
      const double t0 = steady_seconds();
      Status st = codec->encode(&staged[(size_t)out_off[i] * width], {rows, (uint64_t)width}, encoded.get());
      add_codec_seconds(steady_seconds() - t0);
      if (!st.is_ok()) return st.with_context("MoE exchange: encoding rows for rank " + std::to_string(group[i]));
      frames.push_back(OutFrame{encoded->payload.data(), encoded->payload.size(),
                                std::shared_ptr<const void>(encoded, encoded->payload.data())});
      sends.push_back(transport_->send(group[i], tag, std::move(frames), std::move(encoded->metadata), kFlagCompressed));
    } else {
      frames.push_back(slice_frame(staged_buffer, (size_t)out_off[i] * width, rows * width));
      sends.push_back(transport_->send(group[i], tag, std::move(frames)));
    }
  }

  std::vector<IncomingMessage> received(members);
  std::vector<std::vector<float>> decoded(members);  // rows of compressed messages
  for (int i = 0; i < members; ++i) {
    if (!slots[i]) continue;
    auto m = slots[i]->wait(timeout_);
    if (!m) return m.status().with_context("MoE exchange with rank " + std::to_string(group[i]));
    const size_t frame = ids ? 1 : 0;
    const std::string from = " from rank " + std::to_string(group[i]);
    if (m->num_tensors() != frame + 1) return Status::corruption("MoE exchange: malformed rows" + from);
    int nrows = 0;
    if (m->header().flags & kFlagCompressed) {
      auto record = parse_codec_record(std::string(static_cast<const char*>(m->meta_data()), m->meta_size()));
      if (!record) return record.status().with_context("MoE exchange" + from);
      const TensorShape* shape = &record->shape;
      if (shape->cols != static_cast<uint64_t>(width))
        return Status::corruption("MoE exchange: compressed rows of the wrong width" + from);
      // Check the row count before allocating for it: the count we expect,
      // or, while discovering it, no more than a raw message could carry.
      if (!discover && shape->rows != static_cast<uint64_t>(in_counts[i]))
        return Status::corruption("MoE exchange: " + std::to_string(shape->rows) + " compressed rows" + from +
                                  ", expected " + std::to_string(in_counts[i]));
      if (shape->rows * width * sizeof(float) > kMaxDecodedBytes)
        return Status::corruption("MoE exchange: compressed rows beyond the message size limit" + from);
      nrows = static_cast<int>(shape->rows);
      decoded[i].resize((size_t)nrows * width);
      const double t0 = steady_seconds();
      Status st = decode_tensor(*record, static_cast<const uint8_t*>(m->tensor_data(frame)), m->tensor_size(frame),
                                decoded[i].data(), decoded[i].size());
      add_codec_seconds(steady_seconds() - t0);
      XD_RETURN_IF_ERROR(st.with_context("MoE exchange" + from));
    } else {
      if (m->tensor_size(frame) % (sizeof(float) * width) != 0)
        return Status::corruption("MoE exchange: malformed rows" + from);
      nrows = static_cast<int>(m->tensor_size(frame) / (sizeof(float) * width));
    }
    if (ids && m->tensor_size(0) != (size_t)nrows * sizeof(int32_t))
      return Status::corruption("MoE exchange: expert ids do not match rows from rank " + std::to_string(group[i]));
    if (discover) in_counts[i] = nrows;
    else if (nrows != in_counts[i])
      return Status::corruption("MoE exchange: rank " + std::to_string(group[i]) + " sent " +
                                std::to_string(nrows) + " rows, expected " + std::to_string(in_counts[i]));
    received[i] = std::move(*m);
  }
  {
    size_t rows_out = 0, rows_in = 0;
    for (int i = 0; i < members; ++i)
      if (slots[i]) rows_out += out_counts[i], rows_in += in_counts[i];
    std::lock_guard<std::mutex> lock(mu_);
    peak_bytes_[level] += double(std::max(rows_out, rows_in)) * width * sizeof(float);
  }
  in_counts[me] = out_counts[me];
  std::vector<int> in_off(members + 1, 0);
  for (int i = 0; i < members; ++i) in_off[i + 1] = in_off[i] + in_counts[i];
  std::vector<float> result((size_t)in_off[members] * width);
  std::vector<int> result_ids(ids ? in_off[members] : 0);
  for (int i = 0; i < members; ++i) {
    if (in_counts[i] == 0) continue;
    const size_t bytes = (size_t)in_counts[i] * width * sizeof(float);
    if (i == me) {
      std::memcpy(&result[(size_t)in_off[i] * width], &staged[(size_t)out_off[i] * width], bytes);
      if (ids) std::memcpy(&result_ids[in_off[i]], &staged_ids[out_off[i]], sizeof(int) * in_counts[i]);
    } else {
      const size_t frame = ids ? 1 : 0;
      const void* rows = decoded[i].empty() ? received[i].tensor_data(frame) : decoded[i].data();
      std::memcpy(&result[(size_t)in_off[i] * width], rows, bytes);
      if (ids) std::memcpy(&result_ids[in_off[i]], received[i].tensor_data(0), sizeof(int32_t) * in_counts[i]);
    }
  }
  for (auto& c : sends) XD_RETURN_IF_ERROR(c->wait(timeout_));

  if (forward) {
    if (discover) hop->recv_counts = in_counts;
    *data = std::move(result);
    if (ids) *ids = std::move(result_ids);
  } else {
    std::vector<float> restored(hop->send_order.size() * (size_t)width);
    for (size_t k = 0; k < hop->send_order.size(); ++k)
      std::memcpy(&restored[(size_t)hop->send_order[k] * width], &result[k * width], sizeof(float) * width);
    *data = std::move(restored);
  }
  return Status::ok();
}

Status HybridExpertExchange::dispatch(Route* route, const ExchangeTag& tag, const std::vector<int>& counts,
                                      int width, uint32_t step, std::vector<float>* data) {
  Route& r = *route;
  r = Route{};
  r.counts_in = counts;
  r.rows_in = std::accumulate(counts.begin(), counts.end(), 0);
  if (data->size() != (size_t)r.rows_in * width) return Status::internal("MoE exchange: rows do not match counts");
  std::vector<int> ids;
  for (int e = 0; e < (int)counts.size(); ++e) ids.insert(ids.end(), counts[e], e);
  for (int l = 0; l < topology_.num_levels(); ++l) {
    const int members = topology_.level_sizes()[l];
    const int S = topology_.domain_sizes()[l];
    const int my_domain = topology_.domain(rank_, l), my_offset = topology_.offset(rank_, l);
    std::vector<int> dest(ids.size());
    for (size_t k = 0; k < ids.size(); ++k) {
      const int owner_domain = topology_.domain(owner_of(ids[k]), l);
      dest[k] = owner_domain == my_domain ? topology_.coordinate(rank_, l) : owner_domain * S + my_offset;
    }
    Hop hop;
    hop.send_order.resize(ids.size());
    std::iota(hop.send_order.begin(), hop.send_order.end(), 0);
    std::stable_sort(hop.send_order.begin(), hop.send_order.end(),
                     [&](int a, int b) { return dest[a] < dest[b]; });
    hop.send_counts.assign(members, 0);
    for (int d : dest) hop.send_counts[d]++;
    XD_RETURN_IF_ERROR(move(wire_tag(tag, true, l, step), l, &hop, true, true, width, data, &ids));
    r.hops.push_back(std::move(hop));
  }
  r.final_order.resize(ids.size());
  std::iota(r.final_order.begin(), r.final_order.end(), 0);
  for (int id : ids)
    if (computed_index_[id] < 0) return Status::internal("a row reached a worker without its expert");
  std::stable_sort(r.final_order.begin(), r.final_order.end(),
                   [&](int a, int b) { return computed_index_[ids[a]] < computed_index_[ids[b]]; });
  r.out_counts.assign(computed_.size(), 0);
  for (int id : ids) r.out_counts[computed_index_[id]]++;
  return Status::ok();
}

void HybridExpertExchange::add_codec_seconds(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  codec_s_ += s;
}

void HybridExpertExchange::publish(const ExchangeTag& tag, Result result) {
  if (!result.status.is_ok()) fail(result.status);
  std::lock_guard<std::mutex> lock(mu_);
  results_[tag] = std::move(result);
  done_.notify_all();
}

void HybridExpertExchange::run_to_experts(const ExchangeTag& tag, std::vector<float> rows,
                                          const std::vector<int>& counts, int width, uint32_t step) {
  ScopedSpan span(timeline_, tag.phase == (int)ExchangePhase::kDispatch ? "dispatch" : "combine backward", tag.layer,
                  Lane::kToExperts);
  Route& r = route(tag);
  Result result;
  std::vector<float>& data = result.rows;
  data = std::move(rows);
  Status st = status();  // after a failure, only shapes are kept (below)
  if (st.is_ok()) {
    if (tag.phase == (int)ExchangePhase::kDispatch) {
      st = dispatch(&r, tag, counts, width, step, &data);
    } else if (r.hops.size() != (size_t)topology_.num_levels()) {
      st = Status::internal("MoE exchange: a backward exchange without its Dispatch");
    } else if (counts != r.counts_in) {
      st = Status::internal("MoE exchange: backward with other counts than the Dispatch");
    } else {
      for (int l = 0; l < topology_.num_levels() && st.is_ok(); ++l)
        st = move(wire_tag(tag, true, l, step), l, &r.hops[l], true, false, width, &data, nullptr);
    }
  }
  if (!st.is_ok()) {
    // Keep shapes consistent so the math can finish; the trainer checks
    // status() and abandons the step.
    if (tag.phase == (int)ExchangePhase::kDispatch) {
      // This call's route, so its Combine returns as many rows as were sent.
      r = Route{};
      r.counts_in = counts;
      r.rows_in = std::accumulate(counts.begin(), counts.end(), 0);
      r.out_counts.assign(computed_.size(), 0);
    }
    result.status = st;
    result.rows.assign(r.final_order.size() * (size_t)width, 0.0f);
  } else {
    std::vector<float> ordered(r.final_order.size() * (size_t)width);
    for (size_t k = 0; k < r.final_order.size(); ++k)
      std::memcpy(&ordered[k * width], &data[(size_t)r.final_order[k] * width], sizeof(float) * width);
    result.rows = std::move(ordered);
  }
  result.counts = r.out_counts;
  publish(tag, std::move(result));
}

void HybridExpertExchange::run_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width, uint32_t step) {
  ScopedSpan span(timeline_, tag.phase == (int)ExchangePhase::kCombine ? "combine" : "dispatch backward", tag.layer,
                  Lane::kToSources);
  Route& r = route(tag);
  Result result;
  Status st = status();
  std::vector<float> data(r.final_order.size() * (size_t)width);
  if (st.is_ok() && r.hops.size() != (size_t)topology_.num_levels())
    st = Status::internal("MoE exchange: rows sent back without a Dispatch");
  if (st.is_ok() && rows.size() != data.size()) st = Status::internal("MoE exchange: rows do not match the route");
  if (st.is_ok())
    for (size_t k = 0; k < r.final_order.size(); ++k)
      std::memcpy(&data[(size_t)r.final_order[k] * width], &rows[k * width], sizeof(float) * width);
  for (int l = topology_.num_levels() - 1; l >= 0 && st.is_ok(); --l)
    st = move(wire_tag(tag, false, l, step), l, &r.hops[l], false, false, width, &data, nullptr);
  if (st.is_ok() && (int)data.size() != r.rows_in * width) st = Status::internal("MoE exchange lost rows");
  if (!st.is_ok()) {
    result.status = st;
    result.rows.assign((size_t)r.rows_in * width, 0.0f);
  } else {
    result.rows = std::move(data);
  }
  publish(tag, std::move(result));
}

namespace {
bool is_backward(const ExchangeTag& tag) {
  return tag.phase == (int)ExchangePhase::kCombineBackward || tag.phase == (int)ExchangePhase::kDispatchBackward;
}
}  // namespace

// Not overlapped, the whole exchange runs on the compute thread: all of it is
// compute waiting for communication.
template <typename F>
void HybridExpertExchange::run_inline(const ExchangeTag& tag, F run) {
  const double start = steady_seconds();
  run();
  blocked_s_[is_backward(tag) ? 1 : 0] += steady_seconds() - start;
}

HybridExpertExchange::Result HybridExpertExchange::wait_result(const ExchangeTag& tag) {
  const bool backward = is_backward(tag);
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
  blocked_s_[backward ? 1 : 0] += end - start;
  if (timeline_ && timeline_->enabled()) {
    static const char* const kNames[] = {"wait dispatch", "wait combine", "wait combine backward",
                                         "wait dispatch backward"};
    timeline_->add(Span{kNames[tag.phase & 3], tag.layer, Lane::kCompute, true, start, end});
  }
  return result;
}

void HybridExpertExchange::start_to_experts(const ExchangeTag& tag, std::vector<float> rows,
                                            const std::vector<int>& counts, int width) {
  const uint32_t step = step_;
  if (!to_experts_thread_ || local_only_)
    return run_inline(tag, [&] { run_to_experts(tag, std::move(rows), counts, width, step); });
  auto shared_rows = std::make_shared<std::vector<float>>(std::move(rows));
  to_experts_thread_->post([this, tag, shared_rows, counts, width, step] {
    run_to_experts(tag, std::move(*shared_rows), counts, width, step);
  });
}

void HybridExpertExchange::finish_to_experts(const ExchangeTag& tag, std::vector<float>* out,
                                             std::vector<int>* out_counts) {
  Result r = wait_result(tag);
  *out = std::move(r.rows);
  *out_counts = std::move(r.counts);
}

void HybridExpertExchange::start_to_sources(const ExchangeTag& tag, std::vector<float> rows, int width) {
  const uint32_t step = step_;
  if (!to_sources_thread_ || local_only_)
    return run_inline(tag, [&] { run_to_sources(tag, std::move(rows), width, step); });
  auto shared_rows = std::make_shared<std::vector<float>>(std::move(rows));
  to_sources_thread_->post([this, tag, shared_rows, width, step] {
    run_to_sources(tag, std::move(*shared_rows), width, step);
  });
}

void HybridExpertExchange::finish_to_sources(const ExchangeTag& tag, std::vector<float>* out) {
  *out = std::move(wait_result(tag).rows);
}

bool HybridExpertExchange::landed(const ExchangeTag& tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  return results_.count(tag) > 0;
}

}  // namespace xd
