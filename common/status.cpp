#include "common/status.h"

#include <cstdio>
#include <cstring>

namespace hcomm {

std::string_view code_name(Code code) noexcept {
  switch (code) {
    case Code::ok: return "ok";
    case Code::in_progress: return "in_progress";
    case Code::no_resource: return "no_resource";
    case Code::invalid_argument: return "invalid_argument";
    case Code::not_found: return "not_found";
    case Code::io_error: return "io_error";
    case Code::protocol_error: return "protocol_error";
    case Code::timeout: return "timeout";
    case Code::device_error: return "device_error";
    case Code::access_denied: return "access_denied";
    case Code::out_of_range: return "out_of_range";
    case Code::unsupported: return "unsupported";
    case Code::peer_failure: return "peer_failure";
    case Code::closed: return "closed";
  }
  return "unknown";
}

Status Status::error(Code code, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return Status(code, buf);
}

Status Status::from_errno(int err, std::string_view what) {
  std::string msg(what);
  msg += ": ";
  msg += std::strerror(err);
  return Status(err == ETIMEDOUT ? Code::timeout : Code::io_error, std::move(msg));
}

std::string Status::to_string() const {
  std::string s(code_name(_code));
  if (!_message.empty()) {
    s += ": ";
    s += _message;
  }
  return s;
}

}  // namespace hcomm
