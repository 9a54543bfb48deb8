#include "transport/transport.h"

#include <malloc.h>

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "common/log.h"
#include "transport/detail/received_frames.h"
#include "transport/detail/transport_impl.h"

namespace xd {

uint64_t TransportStats::total_rejected() const {
  uint64_t n = 0;
  for (uint64_t r : rejected) n += r;
  return n;
}

Transport::Transport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Transport::~Transport() = default;

Expected<std::unique_ptr<Transport>> Transport::create(const TransportOptions& options) {
  if (options.rank < -1 || options.rank > 0xFFFE) return Status::invalid_argument("rank out of range");
  if (options.link_classes.empty()) return Status::invalid_argument("need at least one link class");
  if (options.keep_freed_memory) {
    static std::once_flag once;
    std::call_once(once, [] {
      mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum for this threshold
      mallopt(M_TRIM_THRESHOLD, 1 << 30);
    });
  }
  auto impl = std::make_unique<Impl>(options);
  XD_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<Transport>(new Transport(std::move(impl)));
}

int Transport::rank() const { return impl_->options.rank; }
uint32_t Transport::job() const { return impl_->options.job; }
const std::string& Transport::endpoint() const { return impl_->endpoint; }

Status Transport::connect(const std::vector<PeerInfo>& peers, int rank, std::optional<uint32_t> job) {
  if (impl_->connected) return Status::invalid_argument("connect() may be called once");
  if (rank > 0xFFFE) return Status::invalid_argument("rank out of range");
  auto done = std::make_shared<std::promise<Status>>();
  auto fut = done->get_future();
  impl_->mailbox.push(ConnectCommand{peers, rank, job, done}, /*urgent=*/true);
  return fut.get();
}

bool Transport::has_peer(int rank) const {
  return impl_->connected && rank >= 0 && rank < (int)impl_->links.size() && impl_->links[rank];
}

std::shared_ptr<Completion> Transport::send(int dst, const Tag& tag, std::vector<OutFrame> frames,
                                            std::string meta, uint16_t flags) {
  XD_CHECK_MSG((flags & ~kKnownFlags) == 0, "unknown message flags");
  FrameHeader h;
  h.kind = tag.kind;
  h.flags = flags;
  h.job = impl_->options.job;
  h.step = tag.step;
  h.layer = tag.layer;
  h.phase = tag.phase;
  h.chunk = tag.chunk;
  h.src = static_cast<uint16_t>(rank());
  h.dst = static_cast<uint16_t>(dst);
  h.meta_len = static_cast<uint32_t>(meta.size());
  for (const OutFrame& f : frames) h.payload_len += f.size;

  if (dst == rank()) {  // loopback inside the process: copy and match directly
    std::vector<zmq::message_t> parts;
    parts.emplace_back(meta.data(), meta.size());
    for (const OutFrame& f : frames) parts.emplace_back(f.data, f.size);
    impl_->deliver(IncomingMessage(h, std::make_unique<detail::ReceivedFrames>(detail::ReceivedFrames{std::move(parts)})));
    auto c = std::make_shared<Completion>(1);
    c->finish_one();
    return c;
  }
  auto completion = std::make_shared<Completion>(static_cast<int>(frames.size()) + 1);
  {
    // Remembered so cancel() can release waiters of sends to dead peers.
    std::lock_guard<std::mutex> lock(impl_->match_mu);
    if (!impl_->cancelled.is_ok()) {
      completion->abort(impl_->cancelled);
      return completion;
    }
    auto& live = impl_->live_sends;
    if (live.size() >= 4096)
      live.erase(std::remove_if(live.begin(), live.end(), [](const auto& w) { return w.expired(); }), live.end());
    live.push_back(completion);
  }
  if (!has_peer(dst)) {
    completion->finish_one(Status::invalid_argument("no link to rank " + std::to_string(dst)));
    return completion;
  }
  Link& link = *impl_->links[dst];
  {
    // Backpressure: wait while this link already holds a full budget.
    std::unique_lock<std::mutex> lock(link.mu);
    link.space.wait(lock, [&] {
      return link.queued_bytes == 0 ||
             link.queued_bytes + h.payload_len <= impl_->options.send_queue_bytes;
    });
    link.queued_bytes += h.payload_len;
  }
  impl_->class_enqueued(link.link_class, h.payload_len);
  // Zero-size frames are released by ZeroMQ like any other.
  PendingSend s{h, std::move(meta), std::move(frames), completion, 0, 0};
  impl_->mailbox.push(SendCommand{dst, std::move(s)});
  return completion;
}

std::shared_ptr<RecvSlot> Transport::recv(int src, const Tag& tag) {
  auto slot = std::make_shared<RecvSlot>();
  MatchKey key{static_cast<uint8_t>(tag.kind), tag.step, tag.layer, tag.phase, tag.chunk,
               static_cast<uint16_t>(src)};
  std::optional<IncomingMessage> ready;
  bool resume_polling = false;
  {
    std::lock_guard<std::mutex> lock(impl_->match_mu);
    if (!impl_->cancelled.is_ok()) {
      slot->fail(impl_->cancelled);
      return slot;
    }
    auto it = impl_->unexpected.find(key);
    if (it != impl_->unexpected.end() && !it->second.empty()) {
      ready = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) impl_->unexpected.erase(it);
      resume_polling = impl_->unexpected_bytes > impl_->options.recv_queue_bytes;
      impl_->unexpected_bytes -= ready->payload_bytes();
    } else {
      impl_->posted[key].push_back(slot);
    }
  }
  if (ready) slot->fulfil(std::move(*ready));
  if (resume_polling) impl_->mailbox.push(WakeCommand{}, true);
  return slot;
}

void Transport::cancel(const Status& why) {
  std::lock_guard<std::mutex> lock(impl_->match_mu);
  impl_->cancelled = why;
  for (auto& [key, slots] : impl_->posted)
    for (auto& s : slots) s->fail(why);
  impl_->posted.clear();
  for (auto& w : impl_->live_sends)
    if (auto c = w.lock()) c->abort(why);
  impl_->live_sends.clear();
}

void Transport::set_timeline(Timeline* timeline) {
  std::lock_guard<std::mutex> lock(impl_->timeline_mu);
  impl_->timeline = timeline;
  impl_->has_timeline.store(timeline != nullptr, std::memory_order_relaxed);
}

void Transport::set_shaping(int link_class, const LinkShaping& s) {
  std::lock_guard<std::mutex> lock(impl_->shaping_mu);
  XD_CHECK(link_class >= 0 && link_class < (int)impl_->shaping.size());
  impl_->shaping[link_class] = s;
}

TransportStats Transport::stats() const {
  TransportStats st;
  for (const auto& l : impl_->links) {
    if (!l) continue;
    LinkStats s;
    s.peer = l->peer;
    s.link_class = l->link_class;
    s.send_buffer_bytes = l->send_buffer_bytes;
    s.bytes_sent = l->bytes_sent;
    s.messages_sent = l->messages_sent;
    s.bytes_received = l->bytes_received;
    s.messages_received = l->messages_received;
    for (int k = 0; k < kMaxMessageKind; ++k) s.bytes_sent_by_kind[k] = l->bytes_sent_by_kind[k];
    std::lock_guard<std::mutex> lock(l->mu);
    s.queued_bytes = l->queued_bytes;
    st.links.push_back(s);
  }
  for (int k = 0; k < kMaxMessageKind; ++k) {
    st.bytes_sent_by_kind[k] = impl_->sent_bytes_kind[k];
    st.bytes_received_by_kind[k] = impl_->recv_bytes_kind[k];
    st.messages_sent_by_kind[k] = impl_->sent_msgs_kind[k];
    st.messages_received_by_kind[k] = impl_->recv_msgs_kind[k];
  }
  for (int r = 0; r < kNumRejectReasons; ++r) st.rejected[r] = impl_->rejected[r];
  for (size_t c = 0; c < impl_->options.link_classes.size(); ++c)
  {
    st.class_transmit_seconds.push_back(impl_->class_transmit_ns[c].load(std::memory_order_relaxed) * 1e-9);
    Impl::ClassBursts& b = impl_->class_bursts[c];
    std::lock_guard<std::mutex> lock(b.mu);
    st.class_bursts.push_back({static_cast<double>(b.bursts), b.bytes, b.seconds});
  }
  return st;
}

}  // namespace xd
