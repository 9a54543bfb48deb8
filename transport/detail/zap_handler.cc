#include "transport/detail/zap_handler.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "common/clock.h"
#include "common/log.h"

namespace xd {

namespace {

struct AllowLists {
  std::mutex mu;
  std::condition_variable listed;  // a domain got its list
  std::map<std::string, std::set<std::string>> keys;  // domain -> Z85 public keys
  std::set<std::string> any_key;                      // domains that admit every key
  std::deque<Refusal> refused;
};

AllowLists& lists() {
  static AllowLists l;
  return l;
}

}  // namespace

void set_allowed_keys(const std::string& domain, const std::vector<std::string>& public_keys, bool any_key) {
  AllowLists& l = lists();
  std::lock_guard<std::mutex> lock(l.mu);
  l.keys[domain] = std::set<std::string>(public_keys.begin(), public_keys.end());
  if (any_key) l.any_key.insert(domain);
  else l.any_key.erase(domain);
  l.listed.notify_all();
}

bool key_is_allowed(const std::string& domain, const std::string& public_key) {
  AllowLists& l = lists();
  std::lock_guard<std::mutex> lock(l.mu);
  auto it = l.keys.find(domain);
  return it != l.keys.end() && it->second.count(public_key) > 0;
}

std::vector<Refusal> refusals() {
  AllowLists& l = lists();
  std::lock_guard<std::mutex> lock(l.mu);
  return {l.refused.begin(), l.refused.end()};
}

namespace detail {

ZapHandler::ZapHandler(zmq::context_t& context) : socket_(context, zmq::socket_type::rep) {
  lists();  // made before this handler, so destroyed after it (a static handler locks it on the way out)
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind("inproc://zeromq.zap.01");
  thread_ = std::thread([this] { run(); });
}

ZapHandler::~ZapHandler() {
  {
    std::lock_guard<std::mutex> lock(lists().mu);
    stop_ = true;
  }
  lists().listed.notify_all();
  thread_.join();
}

void ZapHandler::run() {
  while (!stop_) {
    try {
      zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) == 0) continue;
      // version, request id, domain, address, routing id, mechanism, credentials...
      std::vector<zmq::message_t> frames;
      do {
        frames.emplace_back();
        if (!socket_.recv(frames.back())) break;
      } while (frames.back().more());
      // Short requests (libzmq never sends one) still get an answer: a REP
      // socket that skipped one could never receive again.
      frames.resize(std::max<size_t>(frames.size(), 6));
      const std::string version = frames[0].to_string(), request_id = frames[1].to_string();
      const std::string domain = frames[2].to_string(), address = frames[3].to_string();
      const std::string mechanism = frames[5].to_string();
      std::string user, code = "400", text = "not allowed";
      if (mechanism == "CURVE" && frames.size() >= 7 && frames[6].size() == 32) {
        char z85[41] = {0};
        zmq_z85_encode(z85, static_cast<const uint8_t*>(frames[6].data()), 32);
        user = z85;
        AllowLists& l = lists();
        std::unique_lock<std::mutex> lock(l.mu);
        // A peer that got its assignment first may knock before this worker
        // knows who its peers are: the handshake waits for the list a while.
        l.listed.wait_for(lock, std::chrono::seconds(10), [&] { return l.keys.count(domain) > 0 || stop_; });
        auto it = l.keys.find(domain);
        if (l.any_key.count(domain) || (it != l.keys.end() && it->second.count(user))) code = "200", text = "OK";
        else {
          l.refused.push_back({domain, address, key_label(user), unix_seconds()});
          if (l.refused.size() > 100) l.refused.pop_front();
        }
      } else {
        text = "CURVE only";
      }
      if (code != "200")
        XD_LOG_WARN("security", "refused a %s client from %s (domain %s): key %s is not allowed", mechanism.c_str(),
                    address.c_str(), domain.c_str(), user.empty() ? "-" : key_label(user).c_str());
      const std::string reply[] = {version, request_id, code, text, code == "200" ? user : "", ""};
      for (int i = 0; i < 6; ++i)
        socket_.send(zmq::buffer(reply[i]), i < 5 ? zmq::send_flags::sndmore : zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      if (e.num() != EINTR) XD_LOG_ERROR("security", "ZAP handler: %s", e.what());
    } catch (const std::exception& e) {  // nothing leaves this thread
      XD_LOG_ERROR("security", "ZAP handler: %s", e.what());
    }
  }
}

void apply_socket_security(zmq::socket_t& socket, const SocketSecurity& s, bool server) {
  if (!s.curve) return;
  if (server) {
    socket.set(zmq::sockopt::curve_server, 1);
    socket.set(zmq::sockopt::curve_secretkey, s.own.secret_key);
    socket.set(zmq::sockopt::zap_domain, s.zap_domain);
  } else {
    socket.set(zmq::sockopt::curve_serverkey, s.server_public_key);
    socket.set(zmq::sockopt::curve_publickey, s.own.public_key);
    socket.set(zmq::sockopt::curve_secretkey, s.own.secret_key);
  }
}

void start_control_zap(zmq::context_t& context) {
  static std::once_flag once;
  static std::unique_ptr<ZapHandler> handler;  // destroyed at exit, before the static context made earlier
  std::call_once(once, [&] { handler = std::make_unique<ZapHandler>(context); });
}

}  // namespace detail
}  // namespace xd
