// Internals of Transport: the link table, the match table and the I/O thread.
// Only transport/*.cc include this.
#pragma once

#include <zmq.hpp>

#include "transport/detail/zap_handler.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <variant>
#include <vector>

#include "common/clock.h"
#include "common/timeline.h"
#include "common/mailbox.h"
#include "transport/transport.h"

namespace xd {

struct PendingSend {
  FrameHeader header;
  std::string meta;
  std::vector<OutFrame> frames;
  std::shared_ptr<Completion> completion;
  double enqueued_at = 0;  // steady seconds
  double release_at = 0;   // steady seconds, set when transmission starts
};

// One directed link to a peer. Socket and queue belong to the I/O thread; the
// counters are shared with callers and ZeroMQ's release callbacks.
struct Link {
  int peer = 0;
  int link_class = 0;
  int send_buffer_bytes = 0;              // SO_SNDBUF asked for; 0: autotuning
  std::unique_ptr<zmq::socket_t> dealer;  // I/O thread only
  // The dealer's connection events (its TCP fd), read when a burst of the
  // link class drains (I/O thread only): the burst ends when that socket's
  // peer has acknowledged every byte.
  std::unique_ptr<zmq::socket_t> monitor;
  int tcp_fd = -1;
  // Shaping is a two-stage pipeline: `queue` waits for this worker's egress of
  // the link class to transmit it (bandwidth, shared by every peer of the
  // class), `in_flight` has been transmitted and waits out the latency.
  // A shaping change applies from the next message to transmit.
  std::deque<PendingSend> queue;           // I/O thread only
  std::deque<PendingSend> in_flight;       // I/O thread only
  double last_release = 0;                 // I/O thread only
  bool blocked = false;                    // ZeroMQ said EAGAIN, I/O thread only

  std::atomic<uint64_t> bytes_sent{0}, messages_sent{0}, bytes_received{0}, messages_received{0};
  std::array<std::atomic<uint64_t>, kMaxMessageKind> bytes_sent_by_kind{};
  std::mutex mu;  // guards the fields below
  std::condition_variable space;  // signalled as queued bytes drain
  size_t queued_bytes = 0;
};

using MatchKey = std::tuple<uint8_t, uint32_t, uint16_t, uint16_t, uint32_t, uint16_t>;

struct SendCommand { int dst; PendingSend send; };
struct ConnectCommand {
  std::vector<PeerInfo> peers;
  int rank;
  std::optional<uint32_t> job;
  std::shared_ptr<std::promise<Status>> done;
};
struct StopCommand {};
struct WakeCommand {};
using Command = std::variant<SendCommand, ConnectCommand, StopCommand, WakeCommand>;

class Transport::Impl {
 public:
  explicit Impl(const TransportOptions& options);
  ~Impl();

  Status start();  // binds and starts the I/O thread
  void stop();

  TransportOptions options;
  zmq::context_t context;
  std::unique_ptr<detail::ZapHandler> zap;  // with CURVE; after `context`, so it goes first
  std::string endpoint;
  Mailbox<Command> mailbox;

  std::vector<std::unique_ptr<Link>> links;  // by rank; null for self and non-peers
  std::atomic<bool> connected{false};

  std::mutex match_mu;
  std::map<MatchKey, std::deque<std::shared_ptr<RecvSlot>>> posted;
  std::map<MatchKey, std::deque<IncomingMessage>> unexpected;
  // Changed under match_mu; read without it by the transport thread, which
  // only decides from it whether to poll the router this round.
  std::atomic<size_t> unexpected_bytes{0};
  Status cancelled;  // guarded by match_mu
  std::vector<std::weak_ptr<Completion>> live_sends;  // guarded by match_mu

  mutable std::mutex shaping_mu;
  std::vector<LinkShaping> shaping;

  std::array<std::atomic<uint64_t>, kMaxMessageKind> sent_bytes_kind{}, recv_bytes_kind{},
      sent_msgs_kind{}, recv_msgs_kind{};
  std::array<std::atomic<uint64_t>, kNumRejectReasons> rejected{};
  // Per link class: nanoseconds its shaped egress spent transmitting
  // (bytes / bandwidth of every message), written by the I/O thread.
  std::unique_ptr<std::atomic<uint64_t>[]> class_transmit_ns;
  // Where transmissions are recorded (Transport::set_timeline); the mutex
  // lets set_timeline(nullptr) return only once no span is being added.
  std::atomic<bool> has_timeline{false};
  std::mutex timeline_mu;
  Timeline* timeline = nullptr;
  // Per link class: the periods during which some of its bytes waited to
  // leave (queued, pacing, latency, until ZeroMQ released them), each a
  // sample of t = alpha + bytes * beta for the coordinator's re-fit.
  struct ClassBursts {
    std::mutex mu;
    size_t queued = 0;
    bool draining = false;             // all released; waiting for the peers' acks
    double released_at = 0;            // when the last byte went to ZeroMQ
    double since = 0, bytes_now = 0;   // the open burst
    uint64_t bursts = 0;               // closed bursts, and their bytes and seconds
    double bytes = 0, seconds = 0;
  };
  std::unique_ptr<ClassBursts[]> class_bursts;
  void class_enqueued(int link_class, size_t bytes);
  void class_released(int link_class, size_t bytes);
  // I/O thread: closes the bursts whose bytes every peer has acknowledged
  // (SIOCOUTQ 0 on each of the class's TCP sockets); true while some wait.
  bool close_drained_bursts();
  void receive_link_events(Link& link);

  void deliver(IncomingMessage m);  // to a posted receive or the unexpected store
  void reject(RejectReason why, const std::string& detail);
  void on_frame_released(Link* link, size_t bytes);

 private:
  void run();
  void handle(Command& c);
  void enqueue(SendCommand& c);
  void transmit(int link_class, double now);  // bandwidth stage of one class
  void deliver_due(Link& link, double now);   // latency stage of one link
  double next_event() const;                  // when either stage has work
  std::vector<double> class_busy_until_;      // per link class, I/O thread only
  void receive_all();
  void process(std::vector<zmq::message_t> frames);  // validate, count, deliver
  void receive_monitor_events();
  Status connect_peers(const std::vector<PeerInfo>& peers);

  std::unique_ptr<zmq::socket_t> router_;
  std::unique_ptr<zmq::socket_t> monitor_;
  bool draining_ = false;  // some class's burst waits for acks (I/O thread)
  std::thread io_;
  std::promise<Status> started_;
  std::vector<std::vector<zmq::message_t>> early_;  // arrived before connect()
  size_t early_bytes_ = 0;
  bool stop_ = false;
};

}  // namespace xd
