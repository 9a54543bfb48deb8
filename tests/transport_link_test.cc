// In-process tests of the wire format and of Transport links: two Transports
// talk over real loopback TCP sockets; raw ZeroMQ sockets play hostile peers.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include <msgpack.hpp>
#include <zmq.hpp>

#include "common/units.h"
#include "event.h"
#include "transport/transport.h"

namespace xd {
namespace {

using namespace std::chrono_literals;
using testing::wait_until;

size_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

struct Pair {
  std::unique_ptr<Transport> a, b;  // ranks 0 and 1
};

Pair make_pair(TransportOptions base = {}) {
  TransportOptions oa = base, ob = base;
  oa.rank = 0;
  ob.rank = 1;
  auto a = Transport::create(oa);
  auto b = Transport::create(ob);
  XD_CHECK(a && b);
  std::vector<PeerInfo> peers = {{0, (*a)->endpoint(), 0}, {1, (*b)->endpoint(), 0}};
  XD_CHECK((*a)->connect(peers).is_ok());
  XD_CHECK((*b)->connect(peers).is_ok());
  return {std::move(*a), std::move(*b)};
}

TEST(WireFormat, HeaderRoundTripsEveryField) {
  FrameHeader h;
  h.kind = MessageKind::kAllReduce;
  h.flags = kFlagCompressed;
  h.job = 0xDEADBEEF;
  h.step = 123456;
  h.layer = 7;
  h.phase = 3;
  h.chunk = 0x01000002;
  h.src = 5;
  h.dst = 9;
  h.meta_len = 17;
  h.payload_len = (uint64_t(1) << 40) + 5;
  uint8_t buf[kHeaderSize];
  encode_header(h, buf);
  EXPECT_EQ(buf[0], 'X');
  EXPECT_EQ(buf[3], 'O');
  auto d = decode_header(buf, kHeaderSize);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->kind, h.kind);
  EXPECT_EQ(d->job, h.job);
  EXPECT_EQ(d->step, h.step);
  EXPECT_EQ(d->chunk, h.chunk);
  EXPECT_EQ(d->payload_len, h.payload_len);
  EXPECT_EQ(d->src, 5);
  EXPECT_EQ(d->dst, 9);
}

TEST(WireFormat, ParseHeaderNamesTheBrokenRule) {
  FrameHeader h;
  uint8_t buf[kHeaderSize];
  encode_header(h, buf);
  FrameHeader out;
  RejectReason why;
  EXPECT_FALSE(parse_header(buf, kHeaderSize - 1, &out, &why));
  EXPECT_EQ(why, RejectReason::kBadHeaderSize);
  uint8_t bad[kHeaderSize];
  std::memcpy(bad, buf, kHeaderSize);
  bad[0] ^= 1;
  EXPECT_FALSE(parse_header(bad, kHeaderSize, &out, &why));
  EXPECT_EQ(why, RejectReason::kBadMagic);
  std::memcpy(bad, buf, kHeaderSize);
  bad[4] = 2;
  EXPECT_FALSE(parse_header(bad, kHeaderSize, &out, &why));
  EXPECT_EQ(why, RejectReason::kBadVersion);
  std::memcpy(bad, buf, kHeaderSize);
  bad[5] = 200;
  EXPECT_FALSE(parse_header(bad, kHeaderSize, &out, &why));
  EXPECT_EQ(why, RejectReason::kUnknownKind);
  std::memcpy(bad, buf, kHeaderSize);
  bad[7] = 0x80;
  EXPECT_FALSE(parse_header(bad, kHeaderSize, &out, &why));
  EXPECT_EQ(why, RejectReason::kUnknownFlags);
  EXPECT_TRUE(parse_header(buf, kHeaderSize, &out, &why));
}

TEST(Transport, ReceivesMatchByTagWhetherPostedBeforeOrAfterArrival) {
  Pair p = make_pair();
  const float before[3] = {1, 2, 3}, after[2] = {4, 5};
  auto early = p.b->recv(0, Tag{MessageKind::kPointToPoint, 1, 0, 0, 0});
  p.a->send(1, Tag{MessageKind::kPointToPoint, 1, 0, 0, 0}, {OutFrame::copy_of(before, sizeof before)});
  p.a->send(1, Tag{MessageKind::kPointToPoint, 2, 0, 0, 0}, {OutFrame::copy_of(after, sizeof after)});
  // The second receive is posted only once both messages have arrived.
  const int p2p = static_cast<int>(MessageKind::kPointToPoint);
  ASSERT_TRUE(wait_until([&] { return p.b->stats().messages_received_by_kind[p2p] >= 2; }, 10s));
  auto late = p.b->recv(0, Tag{MessageKind::kPointToPoint, 2, 0, 0, 0});
  auto m1 = early->wait(5s), m2 = late->wait(5s);
  ASSERT_TRUE(m1 && m2);
  ASSERT_EQ(m1->tensor_size(0), sizeof before);
  EXPECT_EQ(std::memcmp(m1->tensor_data(0), before, sizeof before), 0);
  EXPECT_EQ(std::memcmp(m2->tensor_data(0), after, sizeof after), 0);
}

TEST(Transport, ZeroSizeMessagesAndMessagesWithoutFramesArrive) {
  Pair p = make_pair();
  auto r1 = p.b->recv(0, Tag{MessageKind::kAllToAll, 1, 0, 0, 0});
  auto r2 = p.b->recv(0, Tag{MessageKind::kAllToAll, 1, 0, 0, 1});
  p.a->send(1, Tag{MessageKind::kAllToAll, 1, 0, 0, 0}, {OutFrame{nullptr, 0, nullptr}});
  auto done = p.a->send(1, Tag{MessageKind::kAllToAll, 1, 0, 0, 1}, {});
  auto m1 = r1->wait(5s), m2 = r2->wait(5s);
  ASSERT_TRUE(m1 && m2);
  EXPECT_EQ(m1->num_tensors(), 1u);
  EXPECT_EQ(m1->tensor_size(0), 0u);
  EXPECT_EQ(m2->num_tensors(), 0u);
  EXPECT_TRUE(done->wait(5s).is_ok());
}

TEST(Transport, EveryReceivedTensorFrameIsAlignedForFloatsAndKeepsItsBytes) {
  // Many small messages sent at once arrive in few reads, and ZeroMQ leaves
  // each inside its receive buffer at whatever byte it starts; frames of
  // odd sizes put most of them at odd addresses.
  Pair p = make_pair();
  constexpr int kMessages = 64;
  const std::vector<size_t> sizes = {37, 101, 8, 259};
  auto bytes_of = [](int message, size_t frame, size_t i) { return uint8_t(message * 31 + frame * 7 + i); };
  for (int m = 0; m < kMessages; ++m) {
    std::vector<OutFrame> frames;
    for (size_t f = 0; f < sizes.size(); ++f) {
      std::vector<uint8_t> b(sizes[f]);
      for (size_t i = 0; i < b.size(); ++i) b[i] = bytes_of(m, f, i);
      frames.push_back(OutFrame::copy_of(b.data(), b.size()));
    }
    p.a->send(1, Tag{MessageKind::kPointToPoint, 7, 0, 0, (uint32_t)m}, std::move(frames));
  }
  const int p2p = static_cast<int>(MessageKind::kPointToPoint);
  ASSERT_TRUE(wait_until([&] { return p.b->stats().messages_received_by_kind[p2p] >= kMessages; }, 10s));
  for (int m = 0; m < kMessages; ++m) {
    auto got = p.b->recv(0, Tag{MessageKind::kPointToPoint, 7, 0, 0, (uint32_t)m})->wait(5s);
    ASSERT_TRUE(got) << got.status().message();
    ASSERT_EQ(got->num_tensors(), sizes.size());
    for (size_t f = 0; f < sizes.size(); ++f) {
      const auto* data = static_cast<const uint8_t*>(got->tensor_data(f));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % 8, 0u) << "message " << m << ", frame " << f;
      ASSERT_EQ(got->tensor_size(f), sizes[f]);
      for (size_t i = 0; i < sizes[f]; ++i) ASSERT_EQ(data[i], bytes_of(m, f, i)) << "message " << m << ", frame " << f;
    }
  }
}

TEST(Transport, AReceiveFromASilentPeerTimesOutInsteadOfHanging) {
  Pair p = make_pair();
  auto slot = p.b->recv(0, Tag{MessageKind::kBarrier, 9, 0, 0, 0});
  auto m = slot->wait(200ms);
  ASSERT_FALSE(m);
  EXPECT_EQ(m.status().code(), Status::Code::kTimeout);
}

// Raw DEALER sockets, one per routing id: a ROUTER ignores a second live
// connection that claims an id already in use.
struct RawPeers {
  zmq::context_t ctx;
  std::string endpoint;
  std::map<std::string, std::unique_ptr<zmq::socket_t>> sockets;
  void send(const std::string& id, const std::vector<std::string>& frames) {
    auto& s = sockets[id];
    if (!s) {
      s = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
      if (!id.empty()) s->set(zmq::sockopt::routing_id, id);
      s->set(zmq::sockopt::linger, 1000);
      s->connect(endpoint);
    }
    for (size_t i = 0; i < frames.size(); ++i)
      s->send(zmq::buffer(frames[i]), i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
};

std::string header_bytes(FrameHeader h) {
  uint8_t buf[kHeaderSize];
  encode_header(h, buf);
  return std::string(reinterpret_cast<char*>(buf), kHeaderSize);
}

TEST(Transport, MalformedTruncatedAndForeignMessagesAreRejectedCountedAndSurvived) {
  // Rank 2 is a peer that b knows of but that is played here by raw sockets
  // sending broken messages ("w2" is its routing id).
  TransportOptions o3;
  o3.rank = 3;
  auto listener = Transport::create(o3);
  ASSERT_TRUE(listener);
  std::vector<PeerInfo> peers = {{0, (*listener)->endpoint(), 0}, {2, (*listener)->endpoint(), 0}};
  TransportOptions ob;
  ob.rank = 1;
  auto victim = Transport::create(ob);
  ASSERT_TRUE(victim);
  ASSERT_TRUE((*victim)->connect(peers).is_ok());
  const std::string ep = (*victim)->endpoint();
  RawPeers raw;
  raw.endpoint = ep;
  FrameHeader good;
  good.src = 2;
  good.dst = 1;
  good.kind = MessageKind::kPointToPoint;
  auto with = [&](auto f) { FrameHeader h = good; f(h); return header_bytes(h); };

  raw.send("w2", {"only-one-frame"});
  raw.send("w2", {header_bytes(good).substr(0, 20), ""});                // truncated header
  raw.send("w2", {with([](FrameHeader& h) { h.version = 9; }), ""});    // unknown version
  raw.send("w2", {with([](FrameHeader& h) { h.dst = 7; }), ""});         // misaddressed
  raw.send("w2", {with([](FrameHeader& h) { h.src = 0; }), ""});         // src lies
  raw.send("w2", {with([](FrameHeader& h) { h.job = 99; }), ""});        // another job
  raw.send("w2", {with([](FrameHeader& h) { h.payload_len = 100; }), "", "short"});
  raw.send("w2", {with([](FrameHeader& h) { h.payload_len = uint64_t(1) << 40; }), ""});
  raw.send("w2", {with([](FrameHeader& h) { h.meta_len = 3; }), "\xc1\xc1\xc1"});  // bad msgpack
  raw.send("w2", {with([](FrameHeader& h) { h.meta_len = 5; }), "ab"});  // meta length lies
  raw.send("w9", {header_bytes(good), ""});                              // unknown sender
  raw.send("", {header_bytes(good), ""});                                // anonymous
  {
    // Raw TCP garbage: not even ZMTP.
    const int port = std::stoi(ep.substr(ep.rfind(':') + 1));
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    const char junk[] = "GET / HTTP/1.0\r\n\r\nthis is not zmtp at all, not even close............";
    ASSERT_GT(::write(fd, junk, sizeof junk), 0);
    ::close(fd);  // the monitor reports the failed handshake once the connection ends
  }
  // 12 rejections of the messages above (two by unknown senders) and the foreign connection.
  ASSERT_TRUE(wait_until([&] { return (*victim)->stats().total_rejected() >= 13; }, 10s))
      << (*victim)->stats().total_rejected() << " rejections";
  TransportStats st = (*victim)->stats();
  auto count = [&](RejectReason r) { return st.rejected[static_cast<int>(r)]; };
  EXPECT_EQ(count(RejectReason::kTooFewFrames), 1u);
  EXPECT_EQ(count(RejectReason::kBadHeaderSize), 1u);
  EXPECT_EQ(count(RejectReason::kBadVersion), 1u);
  EXPECT_EQ(count(RejectReason::kWrongDestination), 1u);
  EXPECT_EQ(count(RejectReason::kSenderMismatch), 1u);
  EXPECT_EQ(count(RejectReason::kWrongJob), 1u);
  EXPECT_EQ(count(RejectReason::kBadPayloadLength), 1u);
  EXPECT_EQ(count(RejectReason::kOversized), 1u);
  EXPECT_EQ(count(RejectReason::kBadMetadata), 1u);
  EXPECT_EQ(count(RejectReason::kBadMetaLength), 1u);
  EXPECT_EQ(count(RejectReason::kUnknownSender), 2u);
  EXPECT_GE(count(RejectReason::kForeignConnection), 1u);
  // And the victim still serves its real peers.
  TransportOptions oa;
  oa.rank = 0;
  auto sender = Transport::create(oa);
  ASSERT_TRUE(sender);
  ASSERT_TRUE((*sender)->connect({{1, ep, 0}}).is_ok());
  auto slot = (*victim)->recv(0, Tag{MessageKind::kPointToPoint, 77, 0, 0, 0});
  const int v = 42;
  (*sender)->send(1, Tag{MessageKind::kPointToPoint, 77, 0, 0, 0}, {OutFrame::copy_of(&v, sizeof v)});
  auto m = slot->wait(5s);
  ASSERT_TRUE(m);
  EXPECT_EQ(*static_cast<const int*>(m->tensor_data(0)), 42);
}

TEST(Transport, ValidMsgpackMetadataIsAccepted) {
  Pair p = make_pair();
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(1);
  pk.pack(std::string("n"));
  pk.pack(12);
  auto slot = p.b->recv(0, Tag{MessageKind::kControl, 1, 0, 0, 0});
  p.a->send(1, Tag{MessageKind::kControl, 1, 0, 0, 0}, {}, std::string(buf.data(), buf.size()));
  auto m = slot->wait(5s);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->meta_size(), buf.size());
}

TEST(Transport, ABoundedSendQueueKeepsSenderMemoryFlatOnASlowLink) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer holds freed memory in quarantine, so RSS does not show the send queue here";
#elif defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer keeps shadow memory for every byte touched, so RSS does not show the send queue here";
#endif
  TransportOptions o;
  o.send_queue_bytes = size_t(8) << 20;
  o.link_classes = {LinkShaping{1e6, 0}};  // 1 MB/s
  Pair p = make_pair(o);
  const size_t kMessage = size_t(1) << 20, kTotal = 200;
  std::atomic<size_t> sent{0}, received{0};
  std::thread consumer([&] {
    for (size_t i = 0; i < kTotal; ++i) {
      auto m = p.b->recv(0, Tag{MessageKind::kPointToPoint, 0, 0, 0, (uint32_t)i})->wait(60s);
      if (!m) return;
      received++;
    }
  });
  const size_t rss_before = rss_bytes();
  std::thread producer([&] {
    for (size_t i = 0; i < kTotal; ++i) {
      auto buf = std::shared_ptr<uint8_t[]>(new uint8_t[kMessage]);
      std::memset(buf.get(), (int)i, kMessage);  // touch: the pages really exist
      OutFrame f{buf.get(), kMessage, std::shared_ptr<const void>(buf, buf.get())};
      p.a->send(1, Tag{MessageKind::kPointToPoint, 0, 0, 0, (uint32_t)i}, {f});
      sent++;
    }
  });
  size_t peak = 0;
  for (int i = 0; i < 30; ++i) {  // 3 s at 1 MB/s: the producer must be held back
    std::this_thread::sleep_for(100ms);
    peak = std::max(peak, rss_bytes());
  }
  const size_t sent_while_slow = sent;
  EXPECT_LT(sent_while_slow, 16u) << "backpressure did not hold the producer back";
  EXPECT_LT(peak - rss_before, size_t(40) << 20) << "sender memory grew with the backlog";
  // Lift the limit at run time; everything must still arrive, memory still flat.
  p.a->set_shaping(0, LinkShaping{0, 0});
  while (received < kTotal) {
    std::this_thread::sleep_for(20ms);
    peak = std::max(peak, rss_bytes());
  }
  producer.join();
  consumer.join();
  EXPECT_EQ(received.load(), kTotal);
  EXPECT_LT(peak - rss_before, size_t(40) << 20);
  std::printf("[backpressure] sent %zu MB while shaped at 1 MB/s for 3 s; peak RSS growth %.1f MB over 200 MB pushed\n",
              sent_while_slow, (peak - rss_before) / 1048576.0);
}

TEST(Transport, AShapedLinkDeliversItsConfiguredRateAndLatency) {
  TransportOptions o;
  const double rate = 20e6, latency = 0.020;
  o.link_classes = {LinkShaping{rate, latency}};
  Pair p = make_pair(o);
  // Throughput: 40 MB in 256 KiB messages.
  const size_t kMessage = 256 << 10, kCount = 160;
  std::vector<uint8_t> payload(kMessage, 7);
  auto t0 = std::chrono::steady_clock::now();
  std::thread producer([&] {
    for (size_t i = 0; i < kCount; ++i)
      p.a->send(1, Tag{MessageKind::kPointToPoint, 1, 0, 0, (uint32_t)i}, {OutFrame::copy_of(payload.data(), kMessage)});
  });
  double first_arrival = 0;
  for (size_t i = 0; i < kCount; ++i) {
    auto m = p.b->recv(0, Tag{MessageKind::kPointToPoint, 1, 0, 0, (uint32_t)i})->wait(30s);
    ASSERT_TRUE(m);
    if (i == 0) first_arrival = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  producer.join();
  // The egress's transmit time is exactly its bytes over the rate (header and
  // the empty metadata frame included), whatever the scheduling.
  const double sent_bytes = kCount * double(kMessage + kHeaderSize);
  ASSERT_EQ(p.a->stats().class_transmit_seconds.size(), 1u);
  EXPECT_NEAR(p.a->stats().class_transmit_seconds[0], sent_bytes / rate, 1e-6 * kCount);
  EXPECT_LE(p.a->stats().class_transmit_seconds[0], elapsed);
  // The first message pays one latency; the rest stream at the link rate.
  const double achieved = (kCount - 1) * double(kMessage + kHeaderSize) / (elapsed - first_arrival);
  // Latency: ping-pong of empty messages, one-way = RTT / 2.
  std::vector<double> one_ways;
  double worst = 0;
  const int kPings = 11;
  for (int i = 0; i < kPings; ++i) {
    auto pong = p.a->recv(1, Tag{MessageKind::kPointToPoint, 3, 0, 0, (uint32_t)i});
    auto ping = p.b->recv(0, Tag{MessageKind::kPointToPoint, 2, 0, 0, (uint32_t)i});
    auto start = std::chrono::steady_clock::now();
    p.a->send(1, Tag{MessageKind::kPointToPoint, 2, 0, 0, (uint32_t)i}, {});
    ASSERT_TRUE(ping->wait(5s));
    p.b->send(0, Tag{MessageKind::kPointToPoint, 3, 0, 0, (uint32_t)i}, {});
    ASSERT_TRUE(pong->wait(5s));
    const double one_way = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 2;
    worst = std::max(worst, std::abs(one_way - latency));
    one_ways.push_back(one_way);
  }
  std::sort(one_ways.begin(), one_ways.end());
  const double median = one_ways[kPings / 2];
  std::printf("[shaping] configured %.1f MB/s, achieved %.2f MB/s (%.1f%%); latency configured %.1f ms, measured median %.2f ms, worst error %.2f ms\n",
              rate / 1e6, achieved / 1e6, 100 * achieved / rate, latency * 1e3, median * 1e3, worst * 1e3);
  EXPECT_NEAR(achieved, rate, 0.10 * rate);
  EXPECT_NEAR(median, latency, 0.002);
}

TEST(Transport, StatsCountBytesPerLinkAndPerKind) {
  Pair p = make_pair();
  std::vector<uint8_t> data(1000, 1);
  auto slot = p.b->recv(0, Tag{MessageKind::kAllGather, 1, 0, 0, 0});
  p.a->send(1, Tag{MessageKind::kAllGather, 1, 0, 0, 0}, {OutFrame::copy_of(data.data(), 1000)})->wait(5s);
  ASSERT_TRUE(slot->wait(5s));
  TransportStats sa = p.a->stats(), sb = p.b->stats();
  ASSERT_EQ(sa.links.size(), 1u);
  EXPECT_EQ(sa.links[0].bytes_sent, 1000u);
  EXPECT_EQ(sa.links[0].messages_sent, 1u);
  EXPECT_EQ(sb.links[0].bytes_received, 1000u);
  EXPECT_EQ(sa.bytes_sent_by_kind[(int)MessageKind::kAllGather], 1000u);
  EXPECT_EQ(sb.bytes_received_by_kind[(int)MessageKind::kAllGather], 1000u);
}

TEST(LinkShaping, ParsesBandwidthAndDurationUnits) {
  EXPECT_DOUBLE_EQ(*parse_bandwidth("100mbit"), 12.5e6);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("1gbit"), 125e6);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("10MB/s"), 10e6);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("500"), 500);
  EXPECT_FALSE(parse_bandwidth("fast"));
  EXPECT_FALSE(parse_bandwidth("10 parsecs"));
  EXPECT_DOUBLE_EQ(*parse_duration("5ms"), 0.005);
  EXPECT_DOUBLE_EQ(*parse_duration("250us"), 250e-6);
  EXPECT_FALSE(parse_duration("-1s"));
}

}  // namespace
}  // namespace xd

namespace xd {
namespace {

TEST(Transport, PeersOfOneLinkClassShareTheWorkersEgressBandwidth) {
  TransportOptions o;
  o.link_classes = {LinkShaping{20e6, 0}};
  std::vector<std::unique_ptr<Transport>> t;
  for (int r = 0; r < 3; ++r) {
    TransportOptions x = o;
    x.rank = r;
    auto created = Transport::create(x);
    ASSERT_TRUE(created);
    t.push_back(std::move(*created));
  }
  std::vector<PeerInfo> peers;
  for (int r = 0; r < 3; ++r) peers.push_back({r, t[r]->endpoint(), 0});
  for (auto& x : t) ASSERT_TRUE(x->connect(peers).is_ok());
  const size_t kMessage = 1 << 20;
  std::vector<uint8_t> data(kMessage, 3);
  std::vector<std::shared_ptr<RecvSlot>> slots;
  for (int i = 0; i < 10; ++i)
    for (int dst : {1, 2}) slots.push_back(t[dst]->recv(0, Tag{MessageKind::kPointToPoint, 0, 0, 0, (uint32_t)i}));
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i)
    for (int dst : {1, 2}) t[0]->send(dst, Tag{MessageKind::kPointToPoint, 0, 0, 0, (uint32_t)i}, {OutFrame::copy_of(data.data(), kMessage)});
  for (auto& s : slots) ASSERT_TRUE(s->wait(10s));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double expected = 20.0 * kMessage / 20e6;  // both peers together at 20 MB/s
  std::printf("[egress] 20 MB to two peers over one 20 MB/s class took %.3f s (expected %.3f s)\n", seconds, expected);
  EXPECT_NEAR(seconds, expected, 0.1 * expected);
}

TEST(Transport, AShapingChangeAtRunTimeAppliesToTheNextMessages) {
  TransportOptions o;
  o.link_classes = {LinkShaping{5e6, 0}};
  Pair p = make_pair(o);
  const size_t kMessage = 1 << 20;
  std::vector<uint8_t> data(kMessage, 1);
  auto timed_batch = [&](uint32_t step) {
    std::vector<std::shared_ptr<RecvSlot>> slots;
    for (uint32_t i = 0; i < 5; ++i) slots.push_back(p.b->recv(0, Tag{MessageKind::kPointToPoint, step, 0, 0, i}));
    auto start = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < 5; ++i) p.a->send(1, Tag{MessageKind::kPointToPoint, step, 0, 0, i}, {OutFrame::copy_of(data.data(), kMessage)});
    for (auto& s : slots) EXPECT_TRUE(s->wait(10s));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const double slow = timed_batch(1);
  p.a->set_shaping(0, LinkShaping{50e6, 0});
  const double fast = timed_batch(2);
  std::printf("[throttle] 5 MB at 5 MB/s: %.3f s; after raising to 50 MB/s: %.3f s\n", slow, fast);
  EXPECT_NEAR(slow, 5.0 * kMessage / 5e6, 0.15);
  EXPECT_LT(fast, slow / 4);
}

}  // namespace
}  // namespace xd

namespace xd {
namespace {

TEST(Transport, CancelReleasesWaitersOnReceivesAndOnSendsToADeadPeer) {
  TransportOptions o;
  o.rank = 0;
  auto t = Transport::create(o);
  ASSERT_TRUE(t);
  // Rank 1's endpoint has nobody behind it: the send can never leave.
  ASSERT_TRUE((*t)->connect({{1, "tcp://127.0.0.1:9", 0}}).is_ok());
  std::vector<uint8_t> data(1000, 1);
  auto sent = (*t)->send(1, Tag{MessageKind::kPointToPoint, 0, 0, 0, 0}, {OutFrame::copy_of(data.data(), data.size())});
  auto slot = (*t)->recv(1, Tag{MessageKind::kPointToPoint, 0, 0, 0, 0});
  std::thread canceller([&] {
    std::this_thread::sleep_for(100ms);
    (*t)->cancel(Status::unavailable("job stopped"));
  });
  const auto start = std::chrono::steady_clock::now();
  Status st = sent->wait(60s);
  auto m = slot->wait(60s);
  canceller.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(st.code(), Status::Code::kUnavailable);
  ASSERT_FALSE(m);
  EXPECT_EQ(m.status().code(), Status::Code::kUnavailable);
  // And later operations fail at once.
  EXPECT_FALSE((*t)->recv(1, Tag{MessageKind::kPointToPoint, 1, 0, 0, 0})->wait(60s));
  EXPECT_FALSE((*t)->send(1, Tag{MessageKind::kPointToPoint, 1, 0, 0, 0}, {})->wait(60s).is_ok());
}

// Two jobs on one host, each of two workers, whose rank 0 was given the other
// job's rank-1 port (a stale endpoints file, a mistyped config): each job's
// id is set at connect(), as a worker sets it from its assignment, and the
// cross-job messages are dropped and counted while each job's own traffic
// still flows.
TEST(JobIsolation, WorkersPointedAtAnotherJobsPortsRejectAndCountItsMessages) {
  auto make = [](int rank) {
    TransportOptions o;
    o.rank = rank;
    auto t = Transport::create(o);
    XD_CHECK(t);
    return std::move(*t);
  };
  auto a0 = make(0), a1 = make(1), b0 = make(0), b1 = make(1);
  const uint32_t job_a = 0x1111, job_b = 0x2222;
  ASSERT_TRUE(a0->connect({{0, a0->endpoint(), 0}, {1, b1->endpoint(), 0}}, 0, job_a).is_ok());
  ASSERT_TRUE(a1->connect({{0, a0->endpoint(), 0}, {1, a1->endpoint(), 0}}, 1, job_a).is_ok());
  ASSERT_TRUE(b0->connect({{0, b0->endpoint(), 0}, {1, a1->endpoint(), 0}}, 0, job_b).is_ok());
  ASSERT_TRUE(b1->connect({{0, b0->endpoint(), 0}, {1, b1->endpoint(), 0}}, 1, job_b).is_ok());
  EXPECT_EQ(a0->job(), job_a);
  EXPECT_EQ(b1->job(), job_b);

  const Tag tag{MessageKind::kMoeDispatch, 1, 0, 0, 0};
  auto b1_from_0 = b1->recv(0, tag), a1_from_0 = a1->recv(0, tag);
  const int payload = 7;
  a0->send(1, tag, {OutFrame::copy_of(&payload, sizeof payload)});  // lands at job B's rank 1
  b0->send(1, tag, {OutFrame::copy_of(&payload, sizeof payload)});  // lands at job A's rank 1
  const int wrong_job = static_cast<int>(RejectReason::kWrongJob);
  ASSERT_TRUE(wait_until([&] { return b1->stats().rejected[wrong_job] == 1 && a1->stats().rejected[wrong_job] == 1; }, 10s))
      << "rejected as another job's: " << b1->stats().rejected[wrong_job] << " at B1, "
      << a1->stats().rejected[wrong_job] << " at A1";
  EXPECT_FALSE(b1_from_0->ready());
  EXPECT_FALSE(a1_from_0->ready());
  EXPECT_EQ(b1->stats().total_rejected(), 1u);

  // Each job's own traffic is untouched: rank 1 -> rank 0 inside job A.
  auto a0_from_1 = a0->recv(1, tag);
  const int own = 11;
  a1->send(0, tag, {OutFrame::copy_of(&own, sizeof own)});
  auto m = a0_from_1->wait(10s);
  ASSERT_TRUE(m) << m.status().to_string();
  EXPECT_EQ(*static_cast<const int*>(m->tensor_data(0)), 11);
  EXPECT_EQ(a0->stats().total_rejected(), 0u);
}

}  // namespace
}  // namespace xd
