// Which GID of a RoCE port the verbs transport uses: one rule, shared by the
// transport (verbs.cpp) and hcomm-probe (which shows the choice), kept free
// of rdma-core types so that tests/unit runs it on machines without a NIC.
//
// Unforced: the first RoCEv2 GID with an IPv4-mapped address, else the first
// RoCEv2 global IPv6 one; never link-local or RoCEv1.
// HCOMM_IB_GID=N: index N, whatever its type.
// HCOMM_IB_GID=ADDRESS: among the GIDs with that address, the RoCEv2 one
// before the RoCEv1 one (NICs list both for every address: mlx5 puts v1 at
// 2k and v2 at 2k+1), then the lowest index.
// (InfiniBand ports route by LID and take index 0 unless forced: the
// callers' rule, not this one.)
#pragma once

#include <arpa/inet.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace hcomm::api::gid_rule {

struct Entry {
  uint32_t index = 0;
  uint8_t raw[16] = {};
  bool roce_v2 = false;  // else RoCEv1 (or InfiniBand)
};

inline bool ipv4_mapped(const uint8_t* raw) {
  for (int j = 0; j < 10; ++j)
    if (raw[j] != 0) return false;
  return raw[10] == 0xff && raw[11] == 0xff;
}
inline bool link_local(const uint8_t* raw) { return raw[0] == 0xfe && (raw[1] & 0xc0) == 0x80; }

// 0 RoCEv2 IPv4, 1 RoCEv2 global IPv6, 2 RoCEv2 link-local, 3 RoCEv1.
inline int score(const Entry& e) {
  if (!e.roce_v2) return 3;
  if (ipv4_mapped(e.raw)) return 0;
  return link_local(e.raw) ? 2 : 1;
}

// Does HCOMM_IB_GID=force name this entry (by index or by address)?
inline bool named(const Entry& e, const std::string& force) {
  if (force.empty()) return false;
  if (force.find_first_not_of("0123456789") == std::string::npos)
    return force.size() <= 9 && std::stoul(force) == e.index;
  in_addr a4{};
  in6_addr a6{};
  if (::inet_pton(AF_INET, force.c_str(), &a4) == 1) return ipv4_mapped(e.raw) && std::memcmp(e.raw + 12, &a4, 4) == 0;
  return ::inet_pton(AF_INET6, force.c_str(), &a6) == 1 && std::memcmp(e.raw, &a6, 16) == 0;
}

// The position in `table` (all-zero entries already left out) of the GID to
// use, or -1: none qualifies (unforced), or none is named (forced).
inline int choose(const std::vector<Entry>& table, const std::string& force) {
  int best = -1, best_score = 99;
  for (size_t i = 0; i < table.size(); ++i) {
    const int s = score(table[i]);
    if (force.empty() ? s > 1 : !named(table[i], force)) continue;
    if (s < best_score) {
      best = static_cast<int>(i);
      best_score = s;
    }
  }
  return best;
}

}  // namespace hcomm::api::gid_rule
