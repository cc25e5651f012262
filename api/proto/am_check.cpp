#include "api/proto/am_check.h"

#include <utility>

namespace hcomm::api {

namespace {
bool fail(std::string* why, std::string text) {
  if (why != nullptr) *why = std::move(text);
  return false;
}
}  // namespace

bool am_header_ok(const MsgHdr& h, size_t body_len, size_t eager_max, std::string* why) {
  const bool carrier_len = body_len != kBodyInHeader;
  if (h.type < static_cast<uint32_t>(MsgType::eager) || h.type > kLastMsgType)
    return fail(why, "type " + std::to_string(h.type));
  if (h.type != static_cast<uint32_t>(MsgType::eager)) {
    if (carrier_len && body_len != 0)
      return fail(why, "type " + std::to_string(h.type) + " with a body of " + std::to_string(body_len) + " bytes");
    return true;
  }
  if (h.len > eager_max)
    return fail(why, "eager of " + std::to_string(h.len) + " bytes, at most " + std::to_string(eager_max));
  if (h.len != h.total)
    return fail(why, "eager of " + std::to_string(h.len) + " bytes for a message of " + std::to_string(h.total));
  if (carrier_len && h.len != body_len)
    return fail(why, "eager of " + std::to_string(h.len) + " bytes with a body of " + std::to_string(body_len));
  return true;
}

}  // namespace hcomm::api
