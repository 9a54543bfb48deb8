// Transport::Impl's receive side (transport/detail/transport_impl.h): the
// frames the router socket takes in, checked against the wire format and
// refused with a counted reason when they break it, then matched to a
// posted receive or held until one is posted.
#include <msgpack.hpp>

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "common/log.h"
#include "transport/detail/received_frames.h"
#include "transport/detail/transport_impl.h"

namespace xd {

namespace {

MatchKey match_key(const FrameHeader& h) {
  return {static_cast<uint8_t>(h.kind), h.step, h.layer, h.phase, h.chunk, h.src};
}

// "w<rank>" -> rank, or -1.
int parse_routing_id(const zmq::message_t& m) {
  const char* p = static_cast<const char*>(m.data());
  if (m.size() < 2 || m.size() > 7 || p[0] != 'w') return -1;
  int r = 0;
  for (size_t i = 1; i < m.size(); ++i) {
    if (p[i] < '0' || p[i] > '9') return -1;
    r = r * 10 + (p[i] - '0');
  }
  return r;
}

}  // namespace

void Transport::Impl::receive_link_events(Link& link) {
  for (;;) {
    zmq::message_t event, address;
    try {
      if (!link.monitor->recv(event, zmq::recv_flags::dontwait)) return;
      if (event.more()) (void)link.monitor->recv(address, zmq::recv_flags::none);
    } catch (const zmq::error_t&) {
      return;
    }
    if (event.size() < 6) continue;
    uint16_t id;
    uint32_t value;
    std::memcpy(&id, event.data(), 2);
    std::memcpy(&value, static_cast<const char*>(event.data()) + 2, 4);
    if (id == ZMQ_EVENT_CONNECTED) link.tcp_fd = static_cast<int>(value);
    else if (id == ZMQ_EVENT_DISCONNECTED) link.tcp_fd = -1;
  }
}

void Transport::Impl::reject(RejectReason why, const std::string& detail) {
  const uint64_t n = ++rejected[static_cast<int>(why)];
  if (n <= 10 || n % 1000 == 0)
    XD_LOG_WARN("transport", "rank %d dropped a message (%s, #%llu): %s", options.rank,
                reject_reason_name(why), (unsigned long long)n, detail.c_str());
}

void Transport::Impl::deliver(IncomingMessage m) {
  std::shared_ptr<RecvSlot> slot;
  {
    std::lock_guard<std::mutex> lock(match_mu);
    auto it = posted.find(match_key(m.header()));
    if (it != posted.end() && !it->second.empty()) {
      slot = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) posted.erase(it);
    } else {
      unexpected_bytes += m.payload_bytes();
      unexpected[match_key(m.header())].push_back(std::move(m));
      return;
    }
  }
  slot->fulfil(std::move(m));
}

void Transport::Impl::receive_all() {
  for (int budget = 0; budget < 256; ++budget) {
    std::vector<zmq::message_t> frames;
    try {
      zmq::message_t first;
      if (!router_->recv(first, zmq::recv_flags::dontwait)) return;
      frames.push_back(std::move(first));
      while (frames.back().more()) {
        zmq::message_t part;
        (void)router_->recv(part, zmq::recv_flags::none);
        frames.push_back(std::move(part));
      }
    } catch (const zmq::error_t& e) {
      XD_LOG_ERROR("transport", "receive failed: %s", e.what());
      return;
    }
    if (!connected) {
      // A peer may be faster to connect than we are: keep its messages (within
      // the receive budget) until our peer table exists.
      size_t bytes = 0;
      for (const auto& f : frames) bytes += f.size();
      if (early_bytes_ + bytes <= options.recv_queue_bytes) {
        early_bytes_ += bytes;
        early_.push_back(std::move(frames));
        continue;
      }
    }
    process(std::move(frames));
  }
}

void Transport::Impl::process(std::vector<zmq::message_t> frames) {
  {
    if (frames.size() < 3) {
      reject(RejectReason::kTooFewFrames, std::to_string(frames.size()) + " frames");
      return;
    }
    const int sender = parse_routing_id(frames[0]);
    if (sender < 0 || sender >= (int)links.size() || !links[sender]) {
      reject(RejectReason::kUnknownSender, "routing id of " + std::to_string(frames[0].size()) + " bytes");
      return;
    }
    FrameHeader h;
    RejectReason why;
    if (!parse_header(frames[1].data(), frames[1].size(), &h, &why)) {
      reject(why, "from rank " + std::to_string(sender));
      return;
    }
    if (h.src != sender) {
      reject(RejectReason::kSenderMismatch, "header src " + std::to_string(h.src) + " on link of rank " + std::to_string(sender));
      return;
    }
    if (h.dst != options.rank) {
      reject(RejectReason::kWrongDestination, "dst " + std::to_string(h.dst));
      return;
    }
    if (h.job != options.job) {
      reject(RejectReason::kWrongJob, "job " + std::to_string(h.job));
      return;
    }
    if (frames[2].size() != h.meta_len) {
      reject(RejectReason::kBadMetaLength, "from rank " + std::to_string(sender));
      return;
    }
    if (h.payload_len > (uint64_t)options.max_message_bytes) {
      reject(RejectReason::kOversized, std::to_string(h.payload_len) + " bytes");
      return;
    }
    uint64_t payload = 0;
    for (size_t i = 3; i < frames.size(); ++i) payload += frames[i].size();
    if (payload != h.payload_len) {
      reject(RejectReason::kBadPayloadLength, "declared " + std::to_string(h.payload_len) +
                                                  ", carried " + std::to_string(payload));
      return;
    }
    if (h.meta_len > 0) {
      try {
        size_t offset = 0;
        msgpack::object_handle oh = msgpack::unpack(static_cast<const char*>(frames[2].data()),
                                                    frames[2].size(), offset);
        if (offset != frames[2].size()) throw msgpack::insufficient_bytes("trailing bytes");
      } catch (const std::exception& e) {
        reject(RejectReason::kBadMetadata, e.what());
        return;
      }
    }
    Link& link = *links[sender];
    link.messages_received++;
    link.bytes_received += payload;
    recv_bytes_kind[(int)h.kind] += payload;
    recv_msgs_kind[(int)h.kind]++;
    frames.erase(frames.begin(), frames.begin() + 2);
    deliver(IncomingMessage(h, std::make_unique<detail::ReceivedFrames>(detail::ReceivedFrames{std::move(frames)})));
  }
}

void Transport::Impl::receive_monitor_events() {
  for (;;) {
    zmq::message_t event, address;
    try {
      if (!monitor_->recv(event, zmq::recv_flags::dontwait)) return;
      if (event.more()) (void)monitor_->recv(address, zmq::recv_flags::none);
    } catch (const zmq::error_t&) {
      return;
    }
    uint16_t id = 0;
    if (event.size() >= 2) std::memcpy(&id, event.data(), 2);
    reject(RejectReason::kForeignConnection,
           "handshake failed (event 0x" + std::to_string(id) + ") from " + address.to_string());
  }
}

}  // namespace xd
