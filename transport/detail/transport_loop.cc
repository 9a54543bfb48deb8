// Transport::Impl's loop thread (transport/detail/transport_impl.h): start
// and stop, connecting the peers, and the send side: the link classes'
// token buckets, releasing frames to ZeroMQ when the shaping allows, and
// the in-process latency before a frame is handed on.
#include <linux/sockios.h>
#include <sys/ioctl.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/check.h"
#include "common/log.h"
#include "common/thread_name.h"
#include "transport/detail/same_host.h"
#include "transport/detail/transport_impl.h"

namespace xd {

namespace {

std::string routing_id(int rank) {
  std::string id = "w";  // appended, not "w" + ...: GCC 12 warns falsely (-Wrestrict) on that
  id += std::to_string(rank);
  return id;
}

struct ReleaseHint {
  Transport::Impl* impl;
  Link* link;
  size_t bytes;
  std::shared_ptr<const void> owner;
  std::shared_ptr<Completion> completion;
};

void release_frame(void*, void* hint) {
  auto* h = static_cast<ReleaseHint*>(hint);
  h->impl->on_frame_released(h->link, h->bytes);
  h->completion->finish_one();
  delete h;
}

}  // namespace

Transport::Impl::Impl(const TransportOptions& o)
    : options(o),
      context(o.io_threads),
      shaping(o.link_classes),
      class_transmit_ns(new std::atomic<uint64_t>[o.link_classes.size()]()),
      class_bursts(new ClassBursts[o.link_classes.size()]) {
  // Three ZeroMQ sockets a peer (the dealer and its connection monitor's
  // pair): room for thousands of peers, not ZeroMQ's default 1023 sockets.
  zmq_ctx_set(context.handle(), ZMQ_MAX_SOCKETS, 16384);
}

Transport::Impl::~Impl() {
  stop();
  zap.reset();  // its socket would hold the context open
  // Terminating the context releases every frame still queued in ZeroMQ,
  // whose callbacks touch the links: do it while they exist.
  context.close();
}

Status Transport::Impl::start() {
  if (options.security.curve) {
    try {
      zap = std::make_unique<detail::ZapHandler>(context);
    } catch (const zmq::error_t& e) {
      return Status::io_error(std::string("cannot start the ZAP handler: ") + e.what());
    }
  }
  io_ = std::thread([this] { run(); });
  return started_.get_future().get();
}

void Transport::Impl::stop() {
  if (!io_.joinable()) return;
  mailbox.push(StopCommand{}, /*urgent=*/true);
  io_.join();
}

void Transport::Impl::on_frame_released(Link* link, size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(link->mu);
    link->queued_bytes -= bytes;
    link->space.notify_all();
  }
  class_released(link->link_class, bytes);
}

void Transport::Impl::class_enqueued(int link_class, size_t bytes) {
  if (bytes == 0 || link_class < 0 || link_class >= static_cast<int>(options.link_classes.size())) return;
  ClassBursts& c = class_bursts[link_class];
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.queued == 0 && !c.draining) {
    c.since = steady_seconds();
    c.bytes_now = 0;
  }
  c.draining = false;  // more bytes: the same burst goes on
  c.queued += bytes;
  c.bytes_now += bytes;
}

void Transport::Impl::class_released(int link_class, size_t bytes) {
  if (bytes == 0 || link_class < 0 || link_class >= static_cast<int>(options.link_classes.size())) return;
  ClassBursts& c = class_bursts[link_class];
  std::lock_guard<std::mutex> lock(c.mu);
  c.queued -= std::min(bytes, c.queued);
  // ZeroMQ released the last frame into a socket buffer; the bytes still
  // have the wire (and whatever shapes it, a kernel tbf) ahead of them. The
  // I/O thread watches for the acks from now on: wake it.
  if (c.queued == 0) {
    c.draining = true;
    c.released_at = steady_seconds();
    mailbox.push(WakeCommand{});
  }
}

bool Transport::Impl::close_drained_bursts() {
  bool waiting = false;
  for (size_t k = 0; k < options.link_classes.size(); ++k) {
    ClassBursts& c = class_bursts[k];
    double released_at = 0;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (!c.draining) continue;
      released_at = c.released_at;
    }
    // Connection events first, so that a socket ZeroMQ closed is not asked.
    for (auto& l : links)
      if (l && l->link_class == static_cast<int>(k) && l->monitor) receive_link_events(*l);
    // A peer that acknowledges nothing for 2 s (stuck, or gone) ends the
    // burst anyway: the sample is slow, as the link was.
    const bool gave_up = steady_seconds() - released_at > 2.0;
    bool acked = true;
    for (const auto& l : links)
      if (!gave_up && l && l->link_class == static_cast<int>(k) && l->tcp_fd >= 0) {
        int unacked = 0;
        if (::ioctl(l->tcp_fd, SIOCOUTQ, &unacked) == 0 && unacked > 0) acked = false;
      }
    std::lock_guard<std::mutex> lock(c.mu);
    if (!c.draining) continue;  // more bytes came meanwhile
    if (!acked) {
      waiting = true;
      continue;
    }
    c.draining = false;
    ++c.bursts;
    c.bytes += c.bytes_now;
    c.seconds += steady_seconds() - c.since;
  }
  return waiting;
}

void Transport::Impl::run() {
  set_thread_name("xd-transport");
  try {
    router_ = std::make_unique<zmq::socket_t>(context, zmq::socket_type::router);
    router_->set(zmq::sockopt::maxmsgsize, options.max_message_bytes);
    router_->set(zmq::sockopt::rcvhwm, 0);
    router_->set(zmq::sockopt::linger, 0);
    detail::apply_socket_security(*router_, options.security, /*server=*/true);
    if (options.socket_buffer_bytes > 0) {
      router_->set(zmq::sockopt::sndbuf, options.socket_buffer_bytes);
      router_->set(zmq::sockopt::rcvbuf, options.socket_buffer_bytes);
    }
    const std::string monitor_ep = "inproc://xdmoe-monitor-" + std::to_string((uintptr_t)this);
    if (zmq_socket_monitor(router_->handle(), monitor_ep.c_str(),
                           ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0)
      throw zmq::error_t();
    monitor_ = std::make_unique<zmq::socket_t>(context, zmq::socket_type::pair);
    monitor_->connect(monitor_ep);
    router_->bind(options.bind_endpoint);
    endpoint = router_->get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    router_.reset();
    monitor_.reset();
    started_.set_value(Status::io_error("cannot bind '" + options.bind_endpoint + "': " + e.what()));
    return;
  }
  started_.set_value(Status::ok());

  std::vector<zmq::pollitem_t> items;
  std::vector<Link*> polled_links;
  while (!stop_) {
    double now = steady_seconds();
    double next_release = now + 0.1;
    items.clear();
    polled_links.clear();
    items.push_back({nullptr, mailbox.notify_fd(), ZMQ_POLLIN, 0});
    items.push_back({monitor_->handle(), 0, ZMQ_POLLIN, 0});
    const bool accept_more = unexpected_bytes.load(std::memory_order_relaxed) <= options.recv_queue_bytes;
    if (accept_more) items.push_back({router_->handle(), 0, ZMQ_POLLIN, 0});
    for (auto& l : links) {
      if (l && l->blocked) {
        items.push_back({l->dealer->handle(), 0, ZMQ_POLLOUT, 0});
        polled_links.push_back(l.get());
      }
    }
    next_release = std::min(next_release, next_event());
    // zmq_poll counts whole milliseconds; a shaped release due within the next
    // millisecond is waited for precisely instead, so latency stays accurate.
    const double wait = next_release - now;
    long timeout_ms = std::max<long>(0, (long)std::floor(wait * 1000.0));
    if (timeout_ms == 0 && wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    // A burst waiting for its acks is checked every millisecond (polling,
    // so that sends and receives are served meanwhile).
    if (draining_) timeout_ms = std::min(timeout_ms, 1L);
    try {
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(timeout_ms));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) XD_LOG_ERROR("transport", "poll failed: %s", e.what());
      continue;
    }
    if (items[0].revents & ZMQ_POLLIN) {
      mailbox.drain_notifications();
      while (auto c = mailbox.try_pop()) handle(*c);
    }
    if (items[1].revents & ZMQ_POLLIN) receive_monitor_events();
    if (accept_more && (items[2].revents & ZMQ_POLLIN)) receive_all();
    for (Link* l : polled_links) l->blocked = false;
    draining_ = close_drained_bursts();
    now = steady_seconds();
    for (int c = 0; c < (int)class_busy_until_.size(); ++c) transmit(c, now);
    for (auto& l : links)
      if (l && !l->in_flight.empty()) deliver_due(*l, now);
  }
  // Fail receives still waiting: nothing will fulfil them now.
  std::lock_guard<std::mutex> lock(match_mu);
  for (auto& [key, slots] : posted)
    for (auto& s : slots) s->fail(Status::unavailable("transport stopped"));
  posted.clear();
  for (auto& l : links)
    if (l) {
      if (l->dealer) zmq_socket_monitor(l->dealer->handle(), nullptr, 0);
      l->monitor.reset();
      l->dealer.reset();
    }
  monitor_.reset();
  router_.reset();
}

void Transport::Impl::handle(Command& c) {
  if (std::holds_alternative<StopCommand>(c)) {
    stop_ = true;
  } else if (auto* s = std::get_if<SendCommand>(&c)) {
    enqueue(*s);
  } else if (auto* cc = std::get_if<ConnectCommand>(&c)) {
    if (cc->rank >= 0) options.rank = cc->rank;
    if (cc->job) options.job = *cc->job;
    cc->done->set_value(options.rank < 0 ? Status::invalid_argument("connect() needs a rank")
                                         : connect_peers(cc->peers));
  }
}

Status Transport::Impl::connect_peers(const std::vector<PeerInfo>& peers) {
  int max_rank = options.rank;
  for (const PeerInfo& p : peers) max_rank = std::max(max_rank, p.rank);
  if (max_rank > 0xFFFE) return Status::invalid_argument("rank out of range");
  links.resize(max_rank + 1);
  for (const PeerInfo& p : peers) {
    if (p.rank == options.rank) continue;
    if (p.rank < 0) return Status::invalid_argument("negative peer rank");
    if (p.link_class < 0 || p.link_class >= (int)options.link_classes.size())
      return Status::invalid_argument("peer " + std::to_string(p.rank) + " has unknown link class " +
                                      std::to_string(p.link_class));
    auto link = std::make_unique<Link>();
    link->peer = p.rank;
    link->link_class = p.link_class;
    try {
      link->dealer = std::make_unique<zmq::socket_t>(context, zmq::socket_type::dealer);
      link->dealer->set(zmq::sockopt::routing_id, routing_id(options.rank));
      link->dealer->set(zmq::sockopt::sndhwm, 0);  // bounded by our own byte budget
      link->dealer->set(zmq::sockopt::linger, 0);
      if (options.security.curve) {
        if (p.public_key.empty())
          return Status::invalid_argument("CURVE is on, but rank " + std::to_string(p.rank) + " has no public key");
        SocketSecurity client = options.security;
        client.server_public_key = p.public_key;
        detail::apply_socket_security(*link->dealer, client, /*server=*/false);
      }
      if (options.socket_buffer_bytes > 0) {
        link->send_buffer_bytes = options.socket_buffer_bytes;
        link->dealer->set(zmq::sockopt::rcvbuf, options.socket_buffer_bytes);
      } else if (options.local_send_buffer_bytes > 0 && detail::endpoint_is_on_this_host(p.endpoint)) {
        link->send_buffer_bytes = options.local_send_buffer_bytes;
      }
      if (link->send_buffer_bytes > 0) link->dealer->set(zmq::sockopt::sndbuf, link->send_buffer_bytes);
      const std::string events = "inproc://xdmoe-link-" + std::to_string((uintptr_t)this) + "-" + std::to_string(p.rank);
      if (zmq_socket_monitor(link->dealer->handle(), events.c_str(), ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) != 0)
        throw zmq::error_t();
      link->monitor = std::make_unique<zmq::socket_t>(context, zmq::socket_type::pair);
      link->monitor->connect(events);
      link->dealer->connect(p.endpoint);
    } catch (const zmq::error_t& e) {
      return Status::io_error("cannot connect to rank " + std::to_string(p.rank) + " at '" +
                              p.endpoint + "': " + e.what());
    }
    links[p.rank] = std::move(link);
  }
  class_busy_until_.assign(options.link_classes.size(), 0.0);
  connected = true;
  for (auto& frames : early_) process(std::move(frames));
  early_.clear();
  early_bytes_ = 0;
  return Status::ok();
}

void Transport::Impl::enqueue(SendCommand& c) {
  c.send.enqueued_at = steady_seconds();
  links[c.dst]->queue.push_back(std::move(c.send));
}

double Transport::Impl::next_event() const {
  double t = 1e300;
  std::vector<double> earliest(class_busy_until_.size(), 1e300);
  for (const auto& l : links) {
    if (!l) continue;
    if (!l->queue.empty())
      earliest[l->link_class] = std::min(earliest[l->link_class], l->queue.front().enqueued_at);
    if (!l->in_flight.empty() && !l->blocked) t = std::min(t, l->in_flight.front().release_at);
  }
  for (size_t c = 0; c < earliest.size(); ++c)
    if (earliest[c] < 1e300) t = std::min(t, std::max(class_busy_until_[c], earliest[c]));
  return t;
}

void Transport::Impl::transmit(int link_class, double now) {
  LinkShaping sh;
  {
    std::lock_guard<std::mutex> lock(shaping_mu);
    sh = shaping[link_class];
  }
  double& busy_until = class_busy_until_[link_class];
  // A zero-burst token bucket per link class: the worker's egress on this
  // class sends one message after another, oldest first across its peers.
  // Each starts when the egress is free (or when it was queued), so poll
  // jitter does not lower the rate.
  while (busy_until <= now) {
    Link* next = nullptr;
    for (auto& l : links)
      if (l && l->link_class == link_class && !l->queue.empty() &&
          (!next || l->queue.front().enqueued_at < next->queue.front().enqueued_at))
        next = l.get();
    if (!next) return;
    PendingSend s = std::move(next->queue.front());
    next->queue.pop_front();
    const double bytes = double(s.header.payload_len + kHeaderSize + s.meta.size());
    const double start = std::max(busy_until, s.enqueued_at);
    const double transmit_s = sh.bandwidth_bytes_per_s > 0 ? bytes / sh.bandwidth_bytes_per_s : 0.0;
    busy_until = start + transmit_s;
    const double counted_s = transmit_s > 0                     ? transmit_s
                             : sh.accounted_bytes_per_s > 0 ? bytes / sh.accounted_bytes_per_s
                                                            : 0.0;
    class_transmit_ns[link_class].fetch_add(static_cast<uint64_t>(counted_s * 1e9), std::memory_order_relaxed);
    if (transmit_s > 0 && has_timeline.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(timeline_mu);
      if (timeline) timeline->add(Span{"transmit", link_class, Lane::kLink, false, start, busy_until});
    }
    // Latency delays delivery but not the next transmission; FIFO per link.
    next->last_release = std::max(busy_until + sh.latency_s, next->last_release);
    s.release_at = next->last_release;
    next->in_flight.push_back(std::move(s));
  }
}

void Transport::Impl::deliver_due(Link& link, double now) {
  // Delivery stage: hand released messages to ZeroMQ.
  while (!link.in_flight.empty() && !link.blocked && link.in_flight.front().release_at <= now) {
    PendingSend& s = link.in_flight.front();
    uint8_t header[kHeaderSize];
    encode_header(s.header, header);
    try {
      zmq::message_t head(header, kHeaderSize);
      if (!link.dealer->send(head, zmq::send_flags::dontwait | zmq::send_flags::sndmore)) {
        link.blocked = true;
        return;
      }
      zmq::message_t meta(s.meta.data(), s.meta.size());
      link.dealer->send(meta, s.frames.empty() ? zmq::send_flags::none : zmq::send_flags::sndmore);
      for (size_t i = 0; i < s.frames.size(); ++i) {
        OutFrame& f = s.frames[i];
        auto* hint = new ReleaseHint{this, &link, f.size, std::move(f.owner), s.completion};
        zmq::message_t m(const_cast<void*>(f.data), f.size, release_frame, hint);
        link.dealer->send(m, i + 1 < s.frames.size() ? zmq::send_flags::sndmore
                                                     : zmq::send_flags::none);
      }
    } catch (const zmq::error_t& e) {
      XD_LOG_ERROR("transport", "send to rank %d failed: %s", link.peer, e.what());
      s.completion->finish_one(Status::io_error(std::string("send failed: ") + e.what()));
      link.in_flight.pop_front();
      continue;
    }
    link.messages_sent++;
    link.bytes_sent += s.header.payload_len;
    link.bytes_sent_by_kind[(int)s.header.kind] += s.header.payload_len;
    sent_bytes_kind[(int)s.header.kind] += s.header.payload_len;
    sent_msgs_kind[(int)s.header.kind]++;
    s.completion->finish_one();  // the hand-off part
    link.in_flight.pop_front();
  }
}

}  // namespace xd
