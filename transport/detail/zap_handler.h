// ZapHandler: ZeroMQ's authentication hook (ZAP, RFC 27) for one context. A
// thread answers the context's CURVE handshakes on inproc://zeromq.zap.01:
// a client whose public key is on its domain's allow-list
// (transport/security.h) is admitted with that key as its User-Id; any other
// is refused, logged and remembered for `xdmoe status`. Start it before any
// CURVE server socket of the context binds, and destroy it before the
// context: it owns a socket of it.
#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include <zmq.hpp>

#include "transport/security.h"

namespace xd::detail {

class ZapHandler {
 public:
  explicit ZapHandler(zmq::context_t& context);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

 private:
  void run();
  zmq::socket_t socket_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Sets CURVE on `socket` as `security` says (nothing when !security.curve):
// a server's keys and ZAP domain, or a client's keys and its server's key.
// Throws zmq::error_t like the other socket options.
void apply_socket_security(zmq::socket_t& socket, const SocketSecurity& security, bool server);

// The handler of the control channels' shared context (made on first use).
void start_control_zap(zmq::context_t& context);

}  // namespace xd::detail
