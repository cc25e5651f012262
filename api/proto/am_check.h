// The form check every transport applies to an inbound active-message header
// (api/transport/transport.h MsgHdr) before it reaches the protocol
// (Context::on_am). One home for it: shm and verbs each wrote their own.
//
// What it guarantees to on_am, for a header it accepts:
//  - type is eager, rts or fin;
//  - eager: len == total <= eager_max, and the carrier holds exactly len
//    payload bytes after the header (so reading h.len bytes of payload never
//    leaves the received body);
//  - rts / fin: the carrier holds no payload (on_am reads none).
// The header must already be a private copy (copied once out of the shared
// slot or receive buffer, then checked: no second read of peer memory).
#pragma once

#include <cstddef>
#include <string>

#include "api/transport/transport.h"

namespace hcomm::api {

// body_len for a carrier that has no length of its own (a shm ring slot is a
// fixed kSlotSize: the header's len is the only statement of the payload,
// bounded by eager_max = the slot's room after the header).
inline constexpr size_t kBodyInHeader = static_cast<size_t>(-1);

// True when h may be delivered. body_len: payload bytes the carrier received
// after the 64-byte header, or kBodyInHeader. On false, *why (when non-null)
// says what was wrong, for the peer-failure report.
[[nodiscard]] bool am_header_ok(const MsgHdr& h, size_t body_len, size_t eager_max, std::string* why);

}  // namespace hcomm::api
