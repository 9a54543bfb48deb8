// Control-plane channels between the coordinator, workers and CLI clients.
// Messages use the wire format of wire_format.h (header + msgpack metadata,
// no tensor frames); the metadata is a JSON document packed as msgpack.
// ControlServer binds a ROUTER and talks to peers by routing id; ControlClient
// is a DEALER with a chosen routing id. Both are single-threaded: create and
// use each on one thread. Malformed input is dropped and counted; no
// exception leaves these classes.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "transport/security.h"
#include "transport/wire_format.h"

namespace xd {

struct ControlMessage {
  std::string peer;  // routing id of the sender (server side only)
  // The sender's CURVE public key, as the ZAP handler admitted it (server
  // side, CURVE only; transport/security.h); empty on plaintext.
  std::string user_id;
  MessageKind kind = MessageKind::kControl;
  nlohmann::json body;
};

class ControlServer {
 public:
  static Expected<std::unique_ptr<ControlServer>> bind(const std::string& endpoint,
                                                       const SocketSecurity& security = {});
  ~ControlServer();
  const std::string& endpoint() const;  // with the real port
  // Waits up to `timeout` for one message.
  std::optional<ControlMessage> poll(std::chrono::milliseconds timeout);
  Status send(const std::string& peer, MessageKind kind, const nlohmann::json& body);
  uint64_t rejected() const;

  class Impl;

 private:
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class ControlClient {
 public:
  // Connecting never blocks; a missing server shows up as poll() timeouts.
  static Expected<std::unique_ptr<ControlClient>> connect(const std::string& endpoint,
                                                          const std::string& identity,
                                                          const SocketSecurity& security = {});
  ~ControlClient();
  Status send(MessageKind kind, const nlohmann::json& body);
  std::optional<ControlMessage> poll(std::chrono::milliseconds timeout);
  uint64_t rejected() const;

  class Impl;

 private:
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Sends `request` and waits for one reply (CLI commands). unavailable when no
// server answers within `timeout`.
Expected<nlohmann::json> control_request(const std::string& endpoint, const nlohmann::json& request,
                                         std::chrono::milliseconds timeout, const SocketSecurity& security = {});

}  // namespace xd
