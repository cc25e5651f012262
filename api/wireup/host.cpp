#include "api/wireup/host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "common/env.h"
#include "common/fd.h"

namespace hcomm::api {

namespace {


std::string numeric(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* src = sa->sa_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr)
                                               : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(sa)->sin_addr);
  if (::inet_ntop(sa->sa_family, src, buf, sizeof buf) == nullptr) return {};
  return buf;
}

// Case 3: the source address the kernel would use towards MASTER_ADDR.
std::string routed_to(const char* master) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(master, "9", &hints, &res) != 0) return {};
  std::string out;
  for (addrinfo* ai = res; ai != nullptr && out.empty(); ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd.valid() || ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) continue;
    sockaddr_storage ss{};
    socklen_t sl = sizeof ss;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &sl) == 0)
      out = numeric(reinterpret_cast<sockaddr*>(&ss));
  }
  ::freeaddrinfo(res);
  return out;
}

// Cases 2 and 4: walk the interfaces. ifname null: the first up,
// non-loopback IPv4 address.
std::string from_interfaces(const char* ifname, bool* found_if) {
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return {};
  std::string v4, v6;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    if (ifname != nullptr) {
      if (std::strcmp(i->ifa_name, ifname) != 0) continue;
      *found_if = true;
    } else if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) {
      continue;
    }
    if (i->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = numeric(i->ifa_addr);
    // Link-local IPv6 would need a scope id at the peer: skip it.
    if (i->ifa_addr->sa_family == AF_INET6 && v6.empty() &&
        !IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr))
      v6 = numeric(i->ifa_addr);
  }
  ::freeifaddrs(ifs);
  if (!v4.empty()) return v4;
  return ifname != nullptr ? v6 : std::string();
}

}  // namespace

std::string host_id() {
  if (const char* h = env("HCOMM_HOST_ID")) return h;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) std::strcpy(name, "localhost");
  std::string id = name;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  if (in >> boot) id += "/" + boot;
  // The mesh's same-host sockets live in the network namespace's abstract
  // socket space: processes in different namespaces must talk as hosts do.
  char ns[64] = {};
  ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  if (n > 0) id += "/" + std::string(ns, static_cast<size_t>(n));
  return id;
}

Status mesh_listen_address(std::string* addr) {
  if (const char* a = env("HCOMM_SOCKET_ADDR")) {
    in6_addr buf;
    if (::inet_pton(AF_INET, a, &buf) != 1 && ::inet_pton(AF_INET6, a, &buf) != 1)
      return Status::error(Code::invalid_argument, "HCOMM_SOCKET_ADDR=\"%s\" is not a numeric IPv4/IPv6 address", a);
    *addr = a;
    return Status::ok();
  }
  if (const char* ifname = env("HCOMM_SOCKET_IFNAME")) {
    bool found = false;
    std::string a = from_interfaces(ifname, &found);
    if (a.empty())
      return Status::error(Code::not_found, "HCOMM_SOCKET_IFNAME=%s: %s", ifname,
                           found ? "the interface has no usable IPv4/IPv6 address" : "no such interface");
    *addr = a;
    return Status::ok();
  }
  if (const char* master = env("MASTER_ADDR")) {
    if (std::string a = routed_to(master); !a.empty()) {
      *addr = a;
      return Status::ok();
    }
  }
  bool ignored = false;
  std::string a = from_interfaces(nullptr, &ignored);
  *addr = a.empty() ? "127.0.0.1" : a;
  return Status::ok();
}

}  // namespace hcomm::api
