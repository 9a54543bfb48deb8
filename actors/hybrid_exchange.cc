#include "actors/hybrid_exchange.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/clock.h"
#include "common/log.h"

namespace xd {

namespace {
// The most a peer's compressed rows may decode to: the transport's default
// cap on one message (TransportOptions::max_message_bytes).
constexpr uint64_t kMaxDecodedBytes = uint64_t(2) << 30;
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

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
}

void HybridExpertExchange::set_codecs(std::vector<CodecPipeline> to_experts, std::vector<CodecPipeline> to_sources) {
  XD_CHECK(to_experts.size() == static_cast<size_t>(topology_.world_size()) && to_sources.size() == to_experts.size());
  codec_to_experts_ = std::move(to_experts);
  codec_to_sources_ = std::move(to_sources);
}

double HybridExpertExchange::take_codec_seconds() {
  const double s = codec_s_;
  codec_s_ = 0;
  return s;
}

std::vector<std::array<double, 2>> HybridExpertExchange::take_raw_bytes() {
  std::vector<std::array<double, 2>> out = raw_bytes_;
  for (auto& b : raw_bytes_) b = {0.0, 0.0};
  return out;
}

void HybridExpertExchange::set_hooks(LayerHook before, LayerHook after) {
  before_dispatch_ = std::move(before);
  after_dispatch_backward_ = std::move(after);
}

double HybridExpertExchange::take_blocked_seconds() {
  double s = blocked_s_;
  blocked_s_ = 0;
  return s;
}

void HybridExpertExchange::fail(const Status& st) {
  if (status_.is_ok()) status_ = st;
}

Tag HybridExpertExchange::wire_tag(const ExchangeTag& t, bool forward_path, int level) const {
  return Tag{forward_path ? MessageKind::kMoeDispatch : MessageKind::kMoeCombine, step_,
             static_cast<uint16_t>(t.layer), static_cast<uint16_t>(t.phase), static_cast<uint32_t>(level)};
}

Status HybridExpertExchange::move(const Tag& tag, int level, Hop* hop, bool forward, bool discover,
                                  int width, std::vector<float>* data, std::vector<int>* ids) {
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
    raw_bytes_[group[i]][toward_experts ? 0 : 1] += double(rows) * width * sizeof(float);
    std::vector<OutFrame> frames;
    if (ids) frames.push_back(slice_frame(staged_ids_buffer, out_off[i], out_counts[i]));
    const CodecPipeline* codec = codecs.empty() ? nullptr : &codecs[group[i]];
    if (codec && !codec->is_raw()) {
      auto encoded = std::make_shared<EncodedTensor>();
      const double t0 = steady_seconds();
      Status st = codec->encode(&staged[(size_t)out_off[i] * width], {rows, (uint64_t)width}, encoded.get());
      codec_s_ += steady_seconds() - t0;
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
      codec_s_ += steady_seconds() - t0;
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

Status HybridExpertExchange::dispatch(int layer, const float* rows, const std::vector<int>& counts,
                                      int width, std::vector<float>* data) {
  Route& r = routes_[layer];
  r = Route{};
  r.counts_in = counts;
  r.rows_in = std::accumulate(counts.begin(), counts.end(), 0);
  data->assign(rows, rows + (size_t)r.rows_in * width);
  std::vector<int> ids;
  for (int e = 0; e < (int)counts.size(); ++e) ids.insert(ids.end(), counts[e], e);
  const ExchangeTag tag{layer, (int)ExchangePhase::kDispatch};
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
    XD_RETURN_IF_ERROR(move(wire_tag(tag, true, l), l, &hop, true, true, width, data, &ids));
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

void HybridExpertExchange::to_experts(const ExchangeTag& tag, const float* rows,
                                      const std::vector<int>& counts, int width,
                                      std::vector<float>* out, std::vector<int>* out_counts) {
  if (tag.phase == (int)ExchangePhase::kDispatch && before_dispatch_) before_dispatch_(tag.layer);
  const auto start = std::chrono::steady_clock::now();
  if ((int)routes_.size() <= tag.layer) routes_.resize(tag.layer + 1);
  Route& r = routes_[tag.layer];
  std::vector<float> data;
  Status st = status_;
  if (st.is_ok()) {
    if (tag.phase == (int)ExchangePhase::kDispatch) {
      st = dispatch(tag.layer, rows, counts, width, &data);
    } else {
      XD_CHECK_MSG(counts == r.counts_in, "backward exchange with other counts than the Dispatch");
      data.assign(rows, rows + (size_t)r.rows_in * width);
      for (int l = 0; l < topology_.num_levels() && st.is_ok(); ++l)
        st = move(wire_tag(tag, true, l), l, &r.hops[l], true, false, width, &data, nullptr);
    }
  }
  if (!st.is_ok()) {
    // Keep shapes consistent so the math can finish; the trainer checks
    // status() and abandons the step.
    fail(st);
    if (tag.phase == (int)ExchangePhase::kDispatch) {
      r.final_order.clear();
      r.out_counts.assign(computed_.size(), 0);
    }
    out->assign(r.final_order.size() * (size_t)width, 0.0f);
    *out_counts = r.out_counts;
    blocked_s_ += seconds_since(start);
    return;
  }
  out->resize(r.final_order.size() * (size_t)width);
  for (size_t k = 0; k < r.final_order.size(); ++k)
    std::memcpy(&(*out)[k * width], &data[(size_t)r.final_order[k] * width], sizeof(float) * width);
  *out_counts = r.out_counts;
  blocked_s_ += seconds_since(start);
}

void HybridExpertExchange::to_sources(const ExchangeTag& tag, const float* rows, int width,
                                      std::vector<float>* out) {
  const auto start = std::chrono::steady_clock::now();
  XD_CHECK(tag.layer < (int)routes_.size());
  Route& r = routes_[tag.layer];
  std::vector<float> data(r.final_order.size() * (size_t)width);
  for (size_t k = 0; k < r.final_order.size(); ++k)
    std::memcpy(&data[(size_t)r.final_order[k] * width], &rows[k * width], sizeof(float) * width);
  Status st = status_;
  for (int l = topology_.num_levels() - 1; l >= 0 && st.is_ok(); --l)
    st = move(wire_tag(tag, false, l), l, &r.hops[l], false, false, width, &data, nullptr);
  if (!st.is_ok() || (int)data.size() != r.rows_in * width) {
    fail(st.is_ok() ? Status::internal("MoE exchange lost rows") : st);
    out->assign((size_t)r.rows_in * width, 0.0f);
  } else {
    *out = std::move(data);
  }
  blocked_s_ += seconds_since(start);
  if (tag.phase == (int)ExchangePhase::kDispatchBackward && after_dispatch_backward_)
    after_dispatch_backward_(tag.layer);
}

}  // namespace xd
