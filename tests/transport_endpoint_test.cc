// TCP endpoint strings: the host, another host in its place, loopback names.
#include <gtest/gtest.h>

#include "transport/endpoint.h"

namespace xd {
namespace {

TEST(Endpoint, TheHostIsWhatLiesBetweenTheSchemeAndThePort) {
  EXPECT_EQ(endpoint_host("tcp://10.0.0.1:41234"), "10.0.0.1");
  EXPECT_EQ(endpoint_host("tcp://node-a:7371"), "node-a");
  EXPECT_EQ(endpoint_host("tcp://[::1]:7371"), "::1");
  EXPECT_EQ(endpoint_host("ipc:///tmp/x"), "");
  EXPECT_EQ(endpoint_host("tcp://nohost"), "");
  EXPECT_EQ(endpoint_host("tcp://[::1]"), "");  // no port
}

TEST(Endpoint, AnotherHostKeepsThePortAndBracketsAnIpv6Address) {
  EXPECT_EQ(endpoint_with_host("tcp://0.0.0.0:41234", "node-a"), "tcp://node-a:41234");
  EXPECT_EQ(endpoint_with_host("tcp://[::]:41234", "10.0.0.2"), "tcp://10.0.0.2:41234");
  EXPECT_EQ(endpoint_with_host("tcp://0.0.0.0:41234", "fe80::1"), "tcp://[fe80::1]:41234");
  EXPECT_EQ(endpoint_with_host("ipc:///tmp/x", "node-a"), "ipc:///tmp/x");
  EXPECT_EQ(endpoint_with_host("tcp://0.0.0.0:41234", "[::1]"), "tcp://[::1]:41234");
}

TEST(Endpoint, LoopbackNamesAreLocalhostThe127NetworkAndColonColon1) {
  EXPECT_TRUE(is_loopback_host("localhost"));
  EXPECT_TRUE(is_loopback_host("127.0.1.1"));
  EXPECT_TRUE(is_loopback_host("::1"));
  EXPECT_TRUE(is_loopback_host("LOCALHOST"));
  EXPECT_TRUE(is_loopback_host("::ffff:127.0.0.1"));
  EXPECT_FALSE(is_loopback_host("10.77.0.1"));
  EXPECT_FALSE(is_loopback_host("node-a"));
}

}  // namespace
}  // namespace xd
