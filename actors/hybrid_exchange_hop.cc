// HybridExpertExchange's hops: one level's all-to-all, split into its sends
// (send_hop) and its receives (receive_hop), so that the compute thread can
// send at start_* and receive at finish_*, and a comm thread can do both.
#include <cmath>
#include <cstring>

#include "actors/detail/exchange_route.h"
#include "actors/detail/row_order.h"
#include "actors/hybrid_exchange.h"
#include "common/clock.h"

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
// TokenCodecFigures' direction of a hop's messages: 0 toward the experts.
int direction_of(const Tag& tag) { return tag.kind == MessageKind::kMoeDispatch ? 0 : 1; }
}  // namespace

Status HybridExpertExchange::send_hop(HopInFlight* h, std::vector<float>* data, const std::vector<int>* ids) {
  const Tag& tag = h->tag;
  Hop* hop = h->hop;
  const bool forward = h->forward;
  const int width = h->width;
  h->group = topology_.level_group(rank_, h->level);
  h->me = topology_.coordinate(rank_, h->level);
  h->members = static_cast<int>(h->group.size());
  const std::vector<int>& group = h->group;
  const int me = h->me, members = h->members;
  const std::vector<int>& out_counts = forward ? hop->send_counts : hop->recv_counts;
  h->in_counts = forward ? hop->recv_counts : hop->send_counts;
  if (h->discover) h->in_counts.assign(members, 0);
  h->out_off.assign(members + 1, 0);
  std::vector<int>& out_off = h->out_off;
  for (int i = 0; i < members; ++i) out_off[i + 1] = out_off[i] + out_counts[i];

  // Rows move only between A2A pairs of this level; every A2A peer gets a
  // message, empty or not, so nobody waits for a message that never comes.
  std::vector<std::shared_ptr<RecvSlot>>& slots = h->slots;
  slots.assign(members, nullptr);
  bool any_peer = false;
  for (int i = 0; i < members; ++i) {
    if (i == me) continue;
    if (topology_.pair_type(rank_, group[i], h->level) != PairType::kAllToAll) {
      XD_CHECK_MSG(out_counts[i] == 0, "a row was routed to a non-A2A peer");
      continue;
    }
    slots[i] = transport_->recv(group[i], tag);
    any_peer = true;
  }
  h->passthrough = !any_peer && detail::is_identity(hop->send_order);

  // Outgoing rows grouped by member: forward permutes into send order, reverse
  // already holds the received layout. A pass-through hop keeps the rows (and
  // the expert ids) as they are.
  h->staged = std::make_shared<std::vector<float>>(
      forward && !h->passthrough ? detail::rows_gathered(data->data(), hop->send_order, width) : std::move(*data));
  h->staged_ids = std::make_shared<std::vector<int32_t>>();
  const auto& staged_buffer = h->staged;
  const auto& staged_ids_buffer = h->staged_ids;
  std::vector<float>& staged = *staged_buffer;
  std::vector<int32_t>& staged_ids = *staged_ids_buffer;
  if (forward && ids && !h->passthrough) {
    staged_ids.reserve(hop->send_order.size());
    for (int k : hop->send_order) staged_ids.push_back((*ids)[k]);
  }
  const int direction = direction_of(tag);
  const std::vector<CodecPipeline>& codecs = direction == 0 ? codec_to_experts_ : codec_to_sources_;
  std::vector<std::shared_ptr<Completion>>& sends = h->sends;
  for (int i = 0; i < members; ++i) {
    if (!slots[i]) continue;
    const size_t rows = out_counts[i];
    {
      std::lock_guard<std::mutex> lock(mu_);
      figures_[group[i]].raw_bytes[direction] += double(rows) * width * sizeof(float);
    }
    std::vector<OutFrame> frames;
    if (ids) frames.push_back(slice_frame(staged_ids_buffer, out_off[i], out_counts[i]));
    const CodecPipeline* codec = codecs.empty() ? nullptr : &codecs[group[i]];
    const float* rows_at = staged.data() + (size_t)out_off[i] * width;
    if (codec && !codec->is_raw()) {
      auto encoded = std::make_shared<EncodedTensor>();
      const double t0 = thread_cpu_seconds();
      Status st = codec->encode(rows_at, {rows, (uint64_t)width}, encoded.get());
      add_codec_seconds(group[i], direction, {/*encode=*/thread_cpu_seconds() - t0, 0});
      if (st.is_ok()) {
        if (!codec->is_lossless()) sample_token_error(group[i], direction, *codec, rows_at, rows * width, *encoded);
        frames.push_back(OutFrame{encoded->payload.data(), encoded->payload.size(),
                                  std::shared_ptr<const void>(encoded, encoded->payload.data())});
        sends.push_back(
            transport_->send(group[i], tag, std::move(frames), std::move(encoded->metadata), kFlagCompressed));
        continue;
      }
      // Rows the codec cannot take (NaN or Inf: a step the non-finite guard
      // will skip or stop at) cross raw; the receiver takes either.
      if (!codec->refuses_non_finite(rows_at, (uint64_t)rows * width))
        return st.with_context("MoE exchange: encoding rows for rank " + std::to_string(group[i]));
    }
    frames.push_back(slice_frame(staged_buffer, (size_t)out_off[i] * width, rows * width));
    sends.push_back(transport_->send(group[i], tag, std::move(frames)));
  }
  return Status::ok();
}

Status HybridExpertExchange::receive_hop(HopInFlight* h, std::vector<float>* data, std::vector<int>* ids,
                                         bool wait_sends, HopWait* waited) {
  const Hop* hop = h->hop;
  const bool forward = h->forward, discover = h->discover;
  const int width = h->width, level = h->level, me = h->me, members = h->members;
  const std::vector<int>& group = h->group;
  const std::vector<int>& out_counts = forward ? hop->send_counts : hop->recv_counts;
  const std::vector<int>& out_off = h->out_off;
  std::vector<int>& in_counts = h->in_counts;
  const std::vector<std::shared_ptr<RecvSlot>>& slots = h->slots;
  const std::vector<float>& staged = *h->staged;
  const std::vector<int32_t>& staged_ids = *h->staged_ids;
  std::vector<IncomingMessage> received(members);
  std::vector<std::vector<float>> decoded(members);  // rows of compressed messages
  for (int i = 0; i < members; ++i) {
    if (!slots[i]) continue;
    const bool blocks = !slots[i]->ready();
    const double wait_start = blocks ? steady_seconds() : 0;
    auto m = slots[i]->wait(timeout_);
    if (blocks && waited) {
      const double wait_end = steady_seconds();
      if (waited->seconds == 0) waited->from = wait_start;
      waited->seconds += wait_end - wait_start;
      waited->until = wait_end;
    }
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
      const double t0 = thread_cpu_seconds();
      Status st = decode_tensor(*record, static_cast<const uint8_t*>(m->tensor_data(frame)), m->tensor_size(frame),
                                decoded[i].data(), decoded[i].size());
      add_codec_seconds(group[i], direction_of(h->tag), {0, /*decode=*/thread_cpu_seconds() - t0});
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
    // Each link class's peers of the hop as one side each way. The classes
    // are fixed before the first exchange (set_peer_link_classes), so they
    // are counted before the lock.
    std::vector<size_t> rows_out(peak_bytes_.size(), 0), rows_in(peak_bytes_.size(), 0);
    for (int i = 0; i < members; ++i) {
      const int cls = peer_class_.empty() ? level : peer_class_[group[i]];
      if (!slots[i] || cls < 0) continue;
      rows_out[cls] += out_counts[i];
      rows_in[cls] += in_counts[i];
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t c = 0; c < rows_out.size(); ++c)
      peak_bytes_[c] += double(std::max(rows_out[c], rows_in[c])) * width * sizeof(float);
  }
  in_counts[me] = out_counts[me];
  if (h->passthrough) {  // nothing was sent or received; the rows stay in order
    if (forward && discover) h->hop->recv_counts = in_counts;
    *data = std::move(*h->staged);
    return Status::ok();
  }
  std::vector<int> in_off(members + 1, 0);
  for (int i = 0; i < members; ++i) in_off[i + 1] = in_off[i] + in_counts[i];
  // Members in order, each at in_off[i]: forward, appended (not copied over
  // zeros); back toward the sources, each row written once, straight to its
  // place in the send order.
  std::vector<float> result;
  std::vector<const float*> result_rows;
  if (forward) result.reserve((size_t)in_off[members] * width);
  else result_rows.reserve(in_off[members]);
  std::vector<int> result_ids;
  result_ids.reserve(ids ? in_off[members] : 0);
  for (int i = 0; i < members; ++i) {
    if (in_counts[i] == 0) continue;
    const size_t n = (size_t)in_counts[i] * width;
    const float* rows;
    const int32_t* row_ids;
    if (i == me) {
      rows = staged.data() + (size_t)out_off[i] * width;
      row_ids = ids ? staged_ids.data() + out_off[i] : nullptr;
    } else {
      const size_t frame = ids ? 1 : 0;
      rows = decoded[i].empty() ? static_cast<const float*>(received[i].tensor_data(frame)) : decoded[i].data();
      row_ids = ids ? static_cast<const int32_t*>(received[i].tensor_data(0)) : nullptr;
    }
    if (forward) result.insert(result.end(), rows, rows + n);
    else
      for (int t = 0; t < in_counts[i]; ++t) result_rows.push_back(rows + (size_t)t * width);
    if (ids) result_ids.insert(result_ids.end(), row_ids, row_ids + in_counts[i]);
  }
  if (wait_sends)
    for (auto& c : h->sends) XD_RETURN_IF_ERROR(c->wait(timeout_));

  if (forward) {
    if (discover) h->hop->recv_counts = in_counts;
    *data = std::move(result);
    if (ids) *ids = std::move(result_ids);
  } else {
    XD_CHECK(result_rows.size() == hop->send_order.size());
    *data = detail::rows_scattered(result_rows, hop->send_order, width);
  }
  return Status::ok();
}

void HybridExpertExchange::sample_token_error(int peer, int direction, const CodecPipeline& codec,
                                              const float* rows, size_t count, const EncodedTensor& encoded) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (figures_[peer].signal[direction] > 0) return;  // sampled already
  }
  auto record = parse_codec_record(encoded.metadata);
  std::vector<float> decoded(count);
  // The codec just wrote this message: failing to read it back is a broken codec.
  XD_CHECK_MSG(record && decode_tensor(*record, encoded.payload.data(), encoded.payload.size(), decoded.data(),
                                       count).is_ok(),
               ("the token codec " + codec.spec() + " cannot decode its own message").c_str());
  double error = 0, signal = 0;
  for (size_t k = 0; k < count; ++k) {
    if (!std::isfinite(rows[k])) continue;  // a codec that takes them keeps them (bf16, fp16)
    // A value the codec could not hold (beyond fp16's range) counts as lost.
    const double d = std::isfinite(decoded[k]) ? double(rows[k]) - decoded[k] : double(rows[k]);
    error += d * d;
    signal += double(rows[k]) * rows[k];
  }
  std::lock_guard<std::mutex> lock(mu_);
  figures_[peer].error[direction] += error;
  figures_[peer].signal[direction] += signal;
}

bool HybridExpertExchange::hop_landed(const HopInFlight& h) const {
  for (const auto& slot : h.slots)
    if (slot && !slot->ready()) return false;
  return true;
}

}  // namespace xd
