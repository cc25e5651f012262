// Host identity and the address this host's mesh listener uses. Internal to
// api/wireup (connect_mesh), public to tests.
#pragma once

#include <string>

#include "common/status.h"

namespace hcomm::api {

// Which machine this process runs on, as the mesh compares it: env
// HCOMM_HOST_ID if set (tests use it to make ranks on one machine look like
// separate hosts), else "<hostname>/<boot id>/<network namespace>" from
// /proc/sys/kernel/random/boot_id (two machines cloned with one hostname
// still differ) and /proc/self/ns/net (the mesh's same-host sockets are
// abstract AF_UNIX names, which exist per network namespace), each part
// left out when it cannot be read. Same host id = the mesh reaches the peer
// with AF_UNIX and passes it descriptors (shared memory).
std::string host_id();

// The numeric address this rank's cross-host (TCP) mesh listener binds to,
// first match wins:
//  1. env HCOMM_SOCKET_ADDR: a numeric IPv4 / IPv6 address;
//  2. env HCOMM_SOCKET_IFNAME: that interface's first IPv4 address (else its
//     first IPv6 one); not_found when it has neither or does not exist;
//  3. MASTER_ADDR set: the local address of a UDP socket connect()ed to it
//     (the kernel's route choice; no packet is sent);
//  4. the first IPv4 address of an up, non-loopback interface;
//  5. 127.0.0.1.
// A malformed HCOMM_SOCKET_ADDR is invalid_argument.
Status mesh_listen_address(std::string* addr);

}  // namespace hcomm::api
