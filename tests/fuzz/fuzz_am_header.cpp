// The inbound active-message check (api/proto/am_check.h) on arbitrary
// 64 + N byte messages, the way each transport calls it:
//  - verbs: a receive of exactly the input's bytes (the body length is the
//    completion's byte_len - 64);
//  - shm: a fixed ring slot with the input copied to its start (no length of
//    its own: kBodyInHeader).
// Whatever it accepts, the protocol may then read h.len payload bytes
// (Context::on_am): the payload sits in a heap block of exactly the carrier's
// size, so reading past it is an ASan report, and the stated invariants are
// checked outright.
#include <cstdlib>
#include <cstring>
#include <memory>

#include "api/proto/am_check.h"
#include "tests/fuzz/fuzz.h"

using hcomm::api::am_header_ok;
using hcomm::api::kBodyInHeader;
using hcomm::api::MsgHdr;
using hcomm::api::MsgType;

namespace {

// Both transports carry a message in a 4 KiB slot or receive buffer
// (VerbsTransport::kSlot: header + 4032 bytes; a full-form shm slot: its
// sequence line, header + 3968 bytes); 0 and 100 probe the bound.
constexpr size_t kSlot = 4096;
constexpr size_t kEagerMaxes[] = {kSlot - sizeof(MsgHdr), kSlot - 64 - sizeof(MsgHdr), 100, 0};
// The message types the protocol knows (eager, RTS, FIN, RETRACT, CTS, WDONE).
constexpr uint32_t kFirstType = static_cast<uint32_t>(MsgType::eager);
constexpr uint32_t kLastType = hcomm::api::kLastMsgType;

uint64_t sink_sum;  // keeps the payload reads from being optimized away

void consume(const MsgHdr& h, const uint8_t* payload) {
  if (h.type == static_cast<uint32_t>(MsgType::eager))
    for (uint32_t i = 0; i < h.len; ++i) sink_sum += payload[i];  // what on_am copies
}

std::string msg(MsgType type, uint32_t len, uint64_t total, size_t body) {
  MsgHdr h{};
  h.type = static_cast<uint32_t>(type);
  h.len = len;
  h.total = total;
  h.tag = 0x1234;
  h.sreq = 7;
  h.src_slot = hcomm::api::kNoSlot;
  std::string s(reinterpret_cast<const char*>(&h), sizeof h);
  return s + std::string(body, 'p');
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  return {
      msg(MsgType::eager, 0, 0, 0),
      msg(MsgType::eager, 5, 5, 5),
      msg(MsgType::eager, 100, 100, 100),
      msg(MsgType::eager, 4032, 4032, 4032),
      msg(MsgType::eager, 4033, 4033, 4033),
      msg(MsgType::eager, 5, 9, 5),
      msg(MsgType::rts, 0, 1 << 20, 0),
      msg(MsgType::fin, 0, 0, 0),
      msg(MsgType::fin, 0, 0, 3),
      msg(MsgType::retract, 0, 0, 0),
      msg(MsgType::cts, 0, 1 << 20, 0),
      msg(MsgType::wdone, 0, 0, 0),
      msg(MsgType::wdone, 0, 0, 8),
  };
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(MsgHdr)) return 0;  // both transports drop a short message before the check
  MsgHdr h;
  std::memcpy(&h, data, sizeof h);
  const bool eager = h.type == static_cast<uint32_t>(MsgType::eager);
  for (size_t eager_max : kEagerMaxes) {
    // verbs: the body is what arrived after the header, nothing more.
    const size_t body = size - sizeof h;
    std::unique_ptr<uint8_t[]> rx(new uint8_t[body]);
    if (body > 0) std::memcpy(rx.get(), data + sizeof h, body);
    std::string why;
    if (am_header_ok(h, body, eager_max, &why)) {
      if (h.type < kFirstType || h.type > kLastType) std::abort();
      if (eager && (h.len != body || h.len != h.total || h.len > eager_max)) std::abort();
      if (!eager && body != 0) std::abort();
      consume(h, rx.get());
    } else if (why.empty()) {
      std::abort();  // a refusal must say why (it becomes the peer-failure report)
    }
    // shm: a slot of header + eager_max bytes, the input at its start.
    const size_t room = sizeof h + eager_max;
    std::unique_ptr<uint8_t[]> slot(new uint8_t[room]());
    std::memcpy(slot.get(), data, std::min(size, room));
    MsgHdr sh;
    std::memcpy(&sh, slot.get(), sizeof sh);
    why.clear();
    if (am_header_ok(sh, kBodyInHeader, eager_max, &why)) {
      if (sh.type < kFirstType || sh.type > kLastType) std::abort();
      if (eager && (sh.len > eager_max || sh.len != sh.total)) std::abort();
      consume(sh, slot.get() + sizeof sh);
    } else if (why.empty()) {
      std::abort();
    }
  }
  return 0;
}
