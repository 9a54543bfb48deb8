// Hostfiles: `HOST slots=N [dc=NAME]` lines, errors that name the line, and
// the host of each rank.
#include <gtest/gtest.h>

#include "cluster/hostfile.h"
#include "cluster/job_config.h"

namespace xd {
namespace {

ClusterSpec two_dcs_of_two() {
  ClusterSpec c = default_cluster_spec();
  c.levels = {LevelSpec{"dc", 2, LinkClassSpec{"dc", 100e6 / 8, 10e-3, true, {}}},
              LevelSpec{"worker", 2, LinkClassSpec{"worker", 1e9 / 8, 2e-4, true, {}}}};
  return c;
}

TEST(Hostfile, SlotsAndDatacenterNamesAreReadAndCommentsSkipped) {
  auto hosts = parse_hostfile("# two datacenters\n\nnode-b slots=2 dc=west  # second\n  node-a slots=2 dc=east\n",
                              "hosts.txt");
  ASSERT_TRUE(hosts) << hosts.status().to_string();
  ASSERT_EQ(hosts->size(), 2u);
  EXPECT_EQ((*hosts)[0].host, "node-b");
  EXPECT_EQ((*hosts)[0].slots, 2);
  EXPECT_EQ((*hosts)[0].dc, 0);  // the first name seen is coordinate 0
  EXPECT_EQ((*hosts)[1].host, "node-a");
  EXPECT_EQ((*hosts)[1].dc, 1);
}

TEST(Hostfile, AHostWithoutSlotsRunsOneWorkerAndOpenMpisMaxSlotsIsIgnored) {
  auto hosts = parse_hostfile("a\nb slots=3 max_slots=8\n", "h");
  ASSERT_TRUE(hosts) << hosts.status().to_string();
  EXPECT_EQ((*hosts)[0].slots, 1);
  EXPECT_EQ((*hosts)[1].slots, 3);
  EXPECT_EQ((*hosts)[0].dc, -1);
}

TEST(Hostfile, EveryBadLineGetsAnErrorNamingItsLine) {
  const std::pair<const char*, const char*> cases[] = {
      {"a slots=2\nb slot=2\n", "h:2: unknown key 'slot' (slots, dc)"},
      {"a slots=two\n", "h:1: slots must be a positive integer, got 'two'"},
      {"a slots=0\n", "h:1: slots must be at least 1"},
      {"# x\na slots=1 dc=x\nb slots=1\n", "h:3: dc= must be on every line or on none (host 'b')"},
      {"slots=2\n", "h:1: the line must start with a host name, not 'slots=2'"},
      {"a slots\n", "h:1: expected key=value after the host, got 'slots'"},
      {"a slots=1 slots=2\n", "h:1: slots given twice"},
      {"-F/tmp/x slots=1\n", "h:1: a host name cannot start with '-' ('-F/tmp/x')"},
      {"# nothing\n", "h: no hosts"},
  };
  for (const auto& [text, error] : cases) {
    auto hosts = parse_hostfile(text, "h");
    ASSERT_FALSE(hosts) << text;
    EXPECT_EQ(hosts.status().message(), error) << text;
  }
}

TEST(Hostfile, RanksOfEachDatacenterGoToItsHostsInFileOrder) {
  ClusterSpec c = two_dcs_of_two();
  c.hosts = *parse_hostfile("b1 slots=1 dc=b\na1 slots=1 dc=a\nb2 slots=1 dc=b\na2 slots=1 dc=a\n", "h");
  ASSERT_TRUE(c.validate().is_ok()) << c.validate().to_string();
  EXPECT_EQ(hosts_by_rank(c), (std::vector<std::string>{"b1", "b2", "a1", "a2"}));
}

TEST(Hostfile, WithoutDatacentersHostsFillTheRanksInOrder) {
  ClusterSpec c = two_dcs_of_two();
  c.hosts = *parse_hostfile("x slots=3\ny\n", "h");
  ASSERT_TRUE(c.validate().is_ok()) << c.validate().to_string();
  EXPECT_EQ(hosts_by_rank(c), (std::vector<std::string>{"x", "x", "x", "y"}));
}

TEST(Hostfile, SlotsThatDoNotMatchTheLevelsAreRefused) {
  ClusterSpec c = two_dcs_of_two();
  c.hosts = *parse_hostfile("x slots=3\n", "h");
  EXPECT_EQ(c.validate().message(), "cluster.hosts: the slots add up to 3, but the levels describe 4 workers");
  c.hosts = *parse_hostfile("x slots=3 dc=a\ny slots=1 dc=b\n", "h");
  EXPECT_EQ(c.validate().message(), "cluster.hosts: coordinate 0 of level 'dc' has 3 slots, expected 2");
}

}  // namespace
}  // namespace xd
