// Connections to peers on this host get a small send buffer; connections to
// other hosts keep the kernel's autotuning (transport/detail/same_host.h,
// TransportOptions::local_send_buffer_bytes).
#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "transport/detail/same_host.h"
#include "transport/transport.h"

namespace xd {
namespace {

using detail::endpoint_is_on_this_host;

std::string first_non_loopback_ipv4() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  freeifaddrs(list);
  return found;
}

// SO_SNDBUF of this process's TCP socket connected to `port` on loopback; -1
// when there is none.
int send_buffer_of_connection_to(int port) {
  DIR* dir = opendir("/proc/self/fd");
  int result = -1;
  while (dirent* e = dir ? readdir(dir) : nullptr) {
    const int fd = std::atoi(e->d_name);
    sockaddr_in peer{};
    socklen_t len = sizeof peer;
    if (e->d_name[0] == '.' || getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    if (peer.sin_family != AF_INET || ntohs(peer.sin_port) != port) continue;
    int value = 0;
    socklen_t vlen = sizeof value;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &value, &vlen) == 0) result = value;
  }
  if (dir) closedir(dir);
  return result;
}

int port_of(const std::string& endpoint) { return std::atoi(endpoint.substr(endpoint.rfind(':') + 1).c_str()); }

TEST(SameHost, LoopbackAndThisHostsOwnAddressesAreLocal) {
  EXPECT_TRUE(endpoint_is_on_this_host("tcp://127.0.0.1:5555"));
  EXPECT_TRUE(endpoint_is_on_this_host("tcp://127.3.2.1:1"));
  EXPECT_TRUE(endpoint_is_on_this_host("tcp://localhost:80"));
  EXPECT_TRUE(endpoint_is_on_this_host("tcp://[::1]:5555"));
  const std::string own = first_non_loopback_ipv4();
  if (own.empty()) {
    std::printf("no non-loopback IPv4 interface here: own-address case not checked\n");
  } else {
    EXPECT_TRUE(endpoint_is_on_this_host("tcp://" + own + ":5555")) << own;
  }
}

TEST(SameHost, OtherHostsNamesAndNonTcpEndpointsCountAsRemote) {
  EXPECT_FALSE(endpoint_is_on_this_host("tcp://192.0.2.1:5555"));  // TEST-NET-1, never assigned
  EXPECT_FALSE(endpoint_is_on_this_host("tcp://[2001:db8::1]:5555"));
  EXPECT_FALSE(endpoint_is_on_this_host("tcp://worker7.example:5555"));  // not resolved
  EXPECT_FALSE(endpoint_is_on_this_host("ipc:///tmp/xdmoe.sock"));
  EXPECT_FALSE(endpoint_is_on_this_host("tcp://127.0.0.1"));  // no port: malformed
  EXPECT_FALSE(endpoint_is_on_this_host("tcp://[::1:5555"));
  EXPECT_FALSE(endpoint_is_on_this_host(""));
}

struct Linked {
  std::unique_ptr<Transport> a, b;
};

Linked link_two(TransportOptions base) {
  base.rank = 0;
  auto a = Transport::create(base);
  base.rank = 1;
  auto b = Transport::create(base);
  XD_CHECK(a && b);
  // Rank 2 is another host: connecting to it never completes, which is fine.
  std::vector<PeerInfo> peers = {{0, (*a)->endpoint(), 0}, {1, (*b)->endpoint(), 0}, {2, "tcp://192.0.2.1:5555", 0}};
  XD_CHECK((*a)->connect(peers).is_ok());
  XD_CHECK((*b)->connect(peers).is_ok());
  return {std::move(*a), std::move(*b)};
}

int send_buffer_asked(const Transport& t, int peer) {
  for (const LinkStats& l : t.stats().links)
    if (l.peer == peer) return l.send_buffer_bytes;
  return -1;
}

TEST(Transport, ConnectionsToThisHostGetTheSmallSendBufferAndOthersKeepAutotuning) {
  TransportOptions o;
  o.local_send_buffer_bytes = 192 << 10;
  Linked p = link_two(o);
  EXPECT_EQ(send_buffer_asked(*p.a, 1), 192 << 10);
  EXPECT_EQ(send_buffer_asked(*p.a, 2), 0);
  // The option reaches the kernel once the connection is up (Linux doubles it).
  auto slot = p.b->recv(0, Tag{MessageKind::kBarrier, 1, 0, 0, 0});
  ASSERT_TRUE(p.a->send(1, Tag{MessageKind::kBarrier, 1, 0, 0, 0}, {})->wait(std::chrono::seconds(5)).is_ok());
  ASSERT_TRUE(slot->wait(std::chrono::seconds(5)));
  EXPECT_EQ(send_buffer_of_connection_to(port_of(p.b->endpoint())), 2 * (192 << 10));
}

TEST(Transport, ZeroLocalSendBufferAndAnExplicitSocketBufferOverrideTheDefault) {
  TransportOptions autotuned;
  autotuned.local_send_buffer_bytes = 0;
  Linked p = link_two(autotuned);
  EXPECT_EQ(send_buffer_asked(*p.a, 1), 0);

  TransportOptions fixed;
  fixed.socket_buffer_bytes = 96 << 10;
  Linked q = link_two(fixed);
  EXPECT_EQ(send_buffer_asked(*q.a, 1), 96 << 10);
  EXPECT_EQ(send_buffer_asked(*q.a, 2), 96 << 10);  // an explicit size applies to every link
}

}  // namespace
}  // namespace xd
