// Transport: one worker's data plane. It binds one ROUTER socket that every
// peer's DEALER connects to, and owns a single I/O thread that alone touches
// the ZeroMQ sockets. Callers on any thread:
//   * send() a message to a peer: frames are handed to ZeroMQ without copying
//     and kept alive until sent. Each peer link has a bounded send queue; send()
//     blocks while the link's queued bytes exceed the bound (backpressure).
//   * recv() posts a receive that matches (kind, step, layer, phase, chunk, src)
//     of the job; it completes whether the message arrives before or after.
// Links are shaped per link class (bandwidth, latency), changeable at run time.
// Malformed, foreign or misaddressed messages are dropped, counted per reason
// and logged; nothing a peer sends can crash the process. No exception leaves
// this class. Thread-safe, except that rank() and stats() must not race
// connect() (a worker connects once, before its first step).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "transport/link_shaping.h"
#include "transport/security.h"
#include "transport/message.h"
#include "transport/wire_format.h"

namespace xd {

class Timeline;

struct PeerInfo {
  // A constructor, so that {rank, endpoint, link_class} still reads well.
  PeerInfo(int rank_ = 0, std::string endpoint_ = "", int link_class_ = 0, std::string public_key_ = "")
      : rank(rank_), endpoint(std::move(endpoint_)), link_class(link_class_), public_key(std::move(public_key_)) {}
  int rank = 0;
  std::string endpoint;  // e.g. tcp://127.0.0.1:5555
  int link_class = 0;    // index into TransportOptions::link_classes
  std::string public_key;  // the peer's CURVE public key (Z85) when security.curve
};

struct TransportOptions {
  int rank = 0;  // -1: given later by connect()
  // CURVE on every data link: this worker's keys serve its socket (ZAP
  // domain "data"; the allow-list comes with the peers, set_allowed_keys)
  // and authenticate its connections to peers (PeerInfo::public_key).
  SocketSecurity security;
  uint32_t job = 0;  // see connect()
  std::string bind_endpoint = "tcp://127.0.0.1:*";  // '*' picks a free port
  std::vector<LinkShaping> link_classes = {LinkShaping{}};
  std::vector<std::string> link_class_names = {"default"};
  size_t send_queue_bytes = size_t(64) << 20;   // per peer link, backpressure bound
  size_t recv_queue_bytes = size_t(512) << 20;  // unmatched messages held, total
  int64_t max_message_bytes = int64_t(2) << 30;  // ZMQ_MAXMSGSIZE and payload cap
  int io_threads = 1;
  // ZeroMQ mallocs a buffer for every received message, and glibc returns
  // large freed blocks to the kernel, so each collective would fault in and
  // zero its receive buffers again. true: raise glibc's mmap and trim
  // thresholds once per process, so freed buffers are reused (more resident
  // memory, fewer page faults).
  bool keep_freed_memory = true;
  // SO_SNDBUF / SO_RCVBUF of every data socket's TCP connections, in bytes;
  // 0 leaves the kernel's autotuning. The kernel caps it at net.core.wmem_max
  // and rmem_max. When set, it overrides local_send_buffer_bytes.
  int socket_buffer_bytes = 0;
  // SO_SNDBUF of the connections to peers on this host (loopback, or one of
  // its own addresses: detail/same_host.h); 0 leaves autotuning. Workers on one
  // host share its cores; with autotuning a sender pushes megabytes per write
  // and the receivers, waiting for a core, read them after they have left the
  // cache. A small send buffer cuts each write short, so senders and
  // receivers take turns in finer slices (16 MB all_to_allv on 2 cores:
  // 13.2 -> 8.4 ms at 4 ranks, 25.1 -> 23.4 ms at 8; bench/README.md).
  // Links to other hosts keep autotuning, which a long, fast link needs.
  int local_send_buffer_bytes = 256 << 10;
};

struct LinkStats {
  int peer = 0;
  int link_class = 0;
  uint64_t bytes_sent = 0, messages_sent = 0, bytes_received = 0, messages_received = 0;
  size_t queued_bytes = 0;
  int send_buffer_bytes = 0;  // SO_SNDBUF asked for this link's connection; 0: autotuning
  std::array<uint64_t, kMaxMessageKind> bytes_sent_by_kind{};
};

struct TransportStats {
  std::vector<LinkStats> links;
  std::array<uint64_t, kMaxMessageKind> bytes_sent_by_kind{}, bytes_received_by_kind{};
  std::array<uint64_t, kMaxMessageKind> messages_sent_by_kind{}, messages_received_by_kind{};
  std::array<uint64_t, kNumRejectReasons> rejected{};
  // Per link class: the time its shaped egress spent transmitting, the sum of
  // bytes / bandwidth over every message sent (latency excluded: it overlaps
  // the next transmission). 0 for an unshaped class. A step's busiest class
  // is the link half of the step's bound, max(compute, link busy time).
  std::vector<double> class_transmit_seconds;
  // Per link class, over the transport's life: {bursts, bytes, seconds} of
  // the periods during which some of its bytes had not yet reached a peer:
  // from send() until ZeroMQ released the last of them (pacing, latency,
  // queueing behind the class's other peers) and then every peer's TCP
  // socket had them acknowledged (SIOCOUTQ 0: socket buffers and whatever
  // shapes the wire, a kernel tbf, crossed). Each burst is one sample of
  // t = alpha + bytes * beta; their sums let the coordinator re-fit the link.
  std::vector<std::array<double, 3>> class_bursts;
  uint64_t total_rejected() const;
};

class Transport {
 public:
  static Expected<std::unique_ptr<Transport>> create(const TransportOptions& options);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  int rank() const;
  uint32_t job() const;
  // The bound endpoint with the real port, for peers to connect to.
  const std::string& endpoint() const;

  // Opens links to `peers` (own rank is skipped). May be called once. A
  // transport created with rank -1 (a worker that binds before it knows its
  // rank) gets its rank here, and its job id when `job` is given: from then
  // on every message it sends carries that id, and every message it receives
  // must (others are dropped and counted as RejectReason::kWrongJob).
  Status connect(const std::vector<PeerInfo>& peers, int rank = -1, std::optional<uint32_t> job = std::nullopt);
  bool has_peer(int rank) const;

  // Queues a message for `dst` (may be this rank). Blocks under backpressure.
  // The Completion is done when every frame has left (ZeroMQ released it).
  // `meta` is the msgpack metadata frame; `flags` are MessageFlags (for
  // example kFlagCompressed when the tensor frames hold a codec payload).
  std::shared_ptr<Completion> send(int dst, const Tag& tag, std::vector<OutFrame> frames,
                                   std::string meta = {}, uint16_t flags = kFlagNone);
  std::shared_ptr<RecvSlot> recv(int src, const Tag& tag);

  // Fails every posted receive and every later one, and releases every
  // waiter on a send's Completion, with `why` (a job being torn down: peers
  // may be dead, nothing should wait for them).
  void cancel(const Status& why);

  void set_shaping(int link_class, const LinkShaping& shaping);
  // Each transmission of a shaped link class is recorded on `timeline` (when
  // it is enabled) as a span of Lane::kLink whose layer is the link class:
  // when the egress was busy, and when it idled. Null: none. The timeline
  // must outlive the transport or be unset first.
  void set_timeline(Timeline* timeline);
  TransportStats stats() const;

  class Impl;

 private:
  explicit Transport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace xd
