#include "transport/control_channel.h"

#include <cerrno>

#include <unistd.h>

#include <atomic>
#include <random>
#include <zmq.hpp>

#include "common/log.h"
#include "transport/control_body.h"
#include "transport/detail/zap_handler.h"

namespace xd {

namespace {

zmq::context_t& shared_context() {
  static zmq::context_t ctx(1);
  return ctx;
}

std::vector<zmq::message_t> encode(MessageKind kind, const nlohmann::json& body) {
  std::vector<uint8_t> meta = nlohmann::json::to_msgpack(body);
  FrameHeader h;
  h.kind = kind;
  h.meta_len = static_cast<uint32_t>(meta.size());
  uint8_t header[kHeaderSize];
  encode_header(h, header);
  std::vector<zmq::message_t> out;
  out.emplace_back(header, kHeaderSize);
  out.emplace_back(meta.data(), meta.size());
  return out;
}

// Decodes [header, meta] frames; nullopt (and a count) when malformed.
std::optional<ControlMessage> decode(std::vector<zmq::message_t>& frames, size_t first,
                                     std::atomic<uint64_t>* rejected) {
  auto drop = [&](const char* why) -> std::optional<ControlMessage> {
    if (++*rejected <= 10) XD_LOG_WARN("control", "dropped a control message: %s", why);
    return std::nullopt;
  };
  if (frames.size() != first + 2) return drop("wrong frame count");
  FrameHeader h;
  RejectReason why;
  if (!parse_header(frames[first].data(), frames[first].size(), &h, &why))
    return drop(reject_reason_name(why));
  if (h.meta_len != frames[first + 1].size() || h.payload_len != 0) return drop("bad lengths");
  ControlMessage m;
  m.kind = h.kind;
  auto body = unpack_control_body(frames[first + 1].data(), frames[first + 1].size());
  if (!body) return drop(body.status().message().c_str());
  m.body = std::move(*body);
  return m;
}

std::optional<std::vector<zmq::message_t>> receive(zmq::socket_t& s, std::chrono::milliseconds timeout) {
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, timeout) <= 0) return std::nullopt;
  std::vector<zmq::message_t> frames;
  zmq::message_t part;
  if (!s.recv(part, zmq::recv_flags::dontwait)) return std::nullopt;
  frames.push_back(std::move(part));
  while (frames.back().more()) {
    zmq::message_t next;
    (void)s.recv(next, zmq::recv_flags::none);
    frames.push_back(std::move(next));
  }
  return frames;
}

}  // namespace

class ControlServer::Impl {
 public:
  zmq::socket_t socket{shared_context(), zmq::socket_type::router};
  std::string endpoint;
  std::atomic<uint64_t> rejected{0};
};

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlServer::~ControlServer() = default;

Expected<std::unique_ptr<ControlServer>> ControlServer::bind(const std::string& endpoint,
                                                            const SocketSecurity& security) {
  try {
    if (security.curve) detail::start_control_zap(shared_context());
    auto impl = std::make_unique<Impl>();
    detail::apply_socket_security(impl->socket, security, /*server=*/true);
    impl->socket.set(zmq::sockopt::linger, 500);  // final stop orders get out
    impl->socket.set(zmq::sockopt::maxmsgsize, int64_t(16) << 20);
    impl->socket.set(zmq::sockopt::router_mandatory, false);
    impl->socket.bind(endpoint);
    impl->endpoint = impl->socket.get(zmq::sockopt::last_endpoint);
    return std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
  } catch (const zmq::error_t& e) {
    return Status::io_error("cannot bind control endpoint '" + endpoint + "': " + e.what());
  }
}

const std::string& ControlServer::endpoint() const { return impl_->endpoint; }
uint64_t ControlServer::rejected() const { return impl_->rejected; }

std::optional<ControlMessage> ControlServer::poll(std::chrono::milliseconds timeout) {
  try {
    auto frames = receive(impl_->socket, timeout);
    if (!frames) return std::nullopt;
    auto m = decode(*frames, 1, &impl_->rejected);
    if (m) {
      m->peer = (*frames)[0].to_string();
      if (const char* user = zmq_msg_gets((*frames)[1].handle(), "User-Id")) m->user_id = user;
    }
    return m;
  } catch (const zmq::error_t& e) {
    // A signal (the launcher's SIGTERM) interrupts the wait: the caller's loop looks at it.
    if (e.num() != EINTR) XD_LOG_ERROR("control", "receive failed: %s", e.what());
    return std::nullopt;
  }
}

Status ControlServer::send(const std::string& peer, MessageKind kind, const nlohmann::json& body) {
  try {
    auto frames = encode(kind, body);
    zmq::message_t id(peer.data(), peer.size());
    impl_->socket.send(id, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    impl_->socket.send(frames[0], zmq::send_flags::sndmore);
    impl_->socket.send(frames[1], zmq::send_flags::none);
    return Status::ok();
  } catch (const zmq::error_t& e) {
    return Status::unavailable("send to '" + peer + "' failed: " + e.what());
  }
}

class ControlClient::Impl {
 public:
  zmq::socket_t socket{shared_context(), zmq::socket_type::dealer};
  std::atomic<uint64_t> rejected{0};
};

ControlClient::ControlClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlClient::~ControlClient() = default;

Expected<std::unique_ptr<ControlClient>> ControlClient::connect(const std::string& endpoint,
                                                                const std::string& identity,
                                                                const SocketSecurity& security) {
  try {
    auto impl = std::make_unique<Impl>();
    detail::apply_socket_security(impl->socket, security, /*server=*/false);
    impl->socket.set(zmq::sockopt::linger, 200);
    impl->socket.set(zmq::sockopt::routing_id, identity);
    impl->socket.set(zmq::sockopt::maxmsgsize, int64_t(16) << 20);
    // Paranoid Pirate style: reconnect with a backoff that doubles up to a cap.
    impl->socket.set(zmq::sockopt::reconnect_ivl, 100);
    impl->socket.set(zmq::sockopt::reconnect_ivl_max, 3200);
    impl->socket.connect(endpoint);
    return std::unique_ptr<ControlClient>(new ControlClient(std::move(impl)));
  } catch (const zmq::error_t& e) {
    return Status::io_error("cannot connect to '" + endpoint + "': " + e.what());
  }
}

uint64_t ControlClient::rejected() const { return impl_->rejected; }

Status ControlClient::send(MessageKind kind, const nlohmann::json& body) {
  try {
    auto frames = encode(kind, body);
    if (!impl_->socket.send(frames[0], zmq::send_flags::sndmore | zmq::send_flags::dontwait))
      return Status::unavailable("control queue full");
    impl_->socket.send(frames[1], zmq::send_flags::none);
    return Status::ok();
  } catch (const zmq::error_t& e) {
    return Status::unavailable(std::string("control send failed: ") + e.what());
  }
}

std::optional<ControlMessage> ControlClient::poll(std::chrono::milliseconds timeout) {
  try {
    auto frames = receive(impl_->socket, timeout);
    if (!frames) return std::nullopt;
    return decode(*frames, 0, &impl_->rejected);
  } catch (const zmq::error_t& e) {
    // A signal (the launcher's SIGTERM) interrupts the wait: the caller's loop looks at it.
    if (e.num() != EINTR) XD_LOG_ERROR("control", "receive failed: %s", e.what());
    return std::nullopt;
  }
}

Expected<nlohmann::json> control_request(const std::string& endpoint, const nlohmann::json& request,
                                         std::chrono::milliseconds timeout, const SocketSecurity& security) {
  std::random_device rd;
  auto client = ControlClient::connect(endpoint, "cli-" + std::to_string(::getpid()) + "-" +
                                                     std::to_string(rd() % 100000), security);
  if (!client) return client.status();
  XD_RETURN_IF_ERROR((*client)->send(MessageKind::kControl, request));
  auto reply = (*client)->poll(timeout);
  if (!reply)
    return Status::unavailable("no coordinator answered at " + endpoint + " within " +
                               std::to_string(timeout.count()) + " ms" +
                               (security.curve ? " (with CURVE: is the coordinator's public key right, and is this key "
                                                 "allowed? its log names refused keys)"
                                               : " (a coordinator with CURVE keys ignores plaintext clients)"));
  return reply->body;
}

}  // namespace xd
