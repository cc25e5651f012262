// The verbs transport's GID choice (api/transport/verbs/gid_rule.h) on the
// GID tables real NICs present: rxe (RoCEv2 only), mlx5 (a RoCEv1 and a
// RoCEv2 entry for every address, v1 first), IPv6-only hosts.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "api/transport/verbs/gid_rule.h"

namespace {

using hcomm::api::gid_rule::choose;
using hcomm::api::gid_rule::Entry;
using hcomm::api::gid_rule::score;

Entry v4(uint32_t index, const char* ip, bool v2) {
  Entry e;
  e.index = index;
  e.roce_v2 = v2;
  e.raw[10] = e.raw[11] = 0xff;
  EXPECT_EQ(::inet_pton(AF_INET, ip, e.raw + 12), 1);
  return e;
}
Entry v6(uint32_t index, const char* ip, bool v2) {
  Entry e;
  e.index = index;
  e.roce_v2 = v2;
  EXPECT_EQ(::inet_pton(AF_INET6, ip, e.raw), 1);
  return e;
}
// The index chosen, or -1.
int pick(const std::vector<Entry>& t, const std::string& force = "") {
  const int i = choose(t, force);
  return i < 0 ? -1 : static_cast<int>(t[static_cast<size_t>(i)].index);
}

// mlx5 on a host with a link-local and a global IPv6 address and 10.0.0.1.
std::vector<Entry> mlx5() {
  return {v6(0, "fe80::1", false), v6(1, "fe80::1", true), v6(2, "2001:db8::1", false), v6(3, "2001:db8::1", true),
          v4(4, "10.0.0.1", false), v4(5, "10.0.0.1", true)};
}

TEST(GidRule, Scores) {
  EXPECT_EQ(score(v4(0, "10.0.0.1", true)), 0);
  EXPECT_EQ(score(v6(0, "2001:db8::1", true)), 1);
  EXPECT_EQ(score(v6(0, "fe80::1", true)), 2);
  EXPECT_EQ(score(v4(0, "10.0.0.1", false)), 3);
  EXPECT_EQ(score(v6(0, "2001:db8::1", false)), 3);
}

TEST(GidRule, UnforcedTakesRoceV2Ipv4ThenGlobalIpv6) {
  EXPECT_EQ(pick(mlx5()), 5);
  // rxe: link-local v2 at 0, the IPv4 one at 1.
  EXPECT_EQ(pick({v6(0, "fe80::5054:ff:fe12:3401", true), v4(1, "10.0.0.1", true)}), 1);
  // No IPv4 address: the global IPv6 one, never the link-local one.
  EXPECT_EQ(pick({v6(0, "fe80::1", true), v6(1, "2001:db8::1", true)}), 1);
  // Two IPv4 GIDs: the first.
  EXPECT_EQ(pick({v4(2, "10.0.0.2", true), v4(3, "10.0.1.2", true)}), 2);
}

TEST(GidRule, UnforcedNeverLinkLocalOrRoceV1) {
  EXPECT_EQ(pick({v6(0, "fe80::1", true)}), -1);
  EXPECT_EQ(pick({v4(0, "10.0.0.1", false), v6(1, "2001:db8::1", false)}), -1);
  EXPECT_EQ(pick({}), -1);
}

TEST(GidRule, ForcedAddressPrefersRoceV2) {
  // mlx5 lists v1 before v2 for every address: the address means the v2 one.
  EXPECT_EQ(pick(mlx5(), "10.0.0.1"), 5);
  EXPECT_EQ(pick(mlx5(), "2001:db8::1"), 3);
  EXPECT_EQ(pick(mlx5(), "fe80::1"), 1);  // forced: link-local allowed, still v2 first
  // Only a RoCEv1 entry has the address: forcing it is how a user asks for v1.
  EXPECT_EQ(pick({v4(0, "10.0.0.1", false), v4(1, "10.0.0.9", true)}, "10.0.0.1"), 0);
  // An address in another form of the same value.
  EXPECT_EQ(pick(mlx5(), "2001:0db8:0:0::1"), 3);
}

TEST(GidRule, ForcedIndexTakesThatEntryWhateverItsType) {
  EXPECT_EQ(pick(mlx5(), "4"), 4);  // RoCEv1
  EXPECT_EQ(pick(mlx5(), "0"), 0);
  EXPECT_EQ(pick(mlx5(), "7"), -1);  // not in the table
  EXPECT_EQ(pick(mlx5(), "99999999999999999999"), -1);  // no overflow, no match
}

TEST(GidRule, ForcedNameThatMatchesNothing) {
  EXPECT_EQ(pick(mlx5(), "10.0.0.2"), -1);
  EXPECT_EQ(pick(mlx5(), "eth0"), -1);
  EXPECT_EQ(pick(mlx5(), "10.0.0"), -1);
  EXPECT_EQ(pick(mlx5(), "-1"), -1);
}

}  // namespace
