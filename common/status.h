// Status: the one error type of hcomm below the C API.
//
// Cold paths (bring-up, configuration, the vfio-user protocol) return a Status
// that carries a code and a human-readable message. Hot paths return bare
// Codes (see hal/npu/dma_queue.h) so that no string is ever built per op.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace hcomm {

enum class Code : int {
  ok = 0,
  in_progress,       // not finished yet; poll again
  no_resource,       // back-pressure (ring full, no free slot): retry later, not an error
  invalid_argument,  // caller passed something malformed
  not_found,         // no such device / region / mapping
  io_error,          // a system call failed (errno in the message)
  protocol_error,    // the peer sent a malformed or unexpected message
  timeout,           // a deadline passed
  device_error,      // the device reported an error (completion status / status register)
  access_denied,     // rights or key check failed
  out_of_range,      // address or length outside what was mapped / registered
  unsupported,       // the device or build lacks the feature
  peer_failure,      // the other side vanished
  closed,            // the object was shut down
};

std::string_view code_name(Code code) noexcept;

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : _code(code), _message(std::move(message)) {}

  static Status ok() { return {}; }
  // printf-style constructor for error paths.
  [[gnu::format(printf, 2, 3)]] static Status error(Code code, const char* fmt, ...);
  // errno-carrying constructor: "<what>: <strerror(err)>".
  static Status from_errno(int err, std::string_view what);

  bool is_ok() const noexcept { return _code == Code::ok; }
  explicit operator bool() const noexcept { return is_ok(); }
  Code code() const noexcept { return _code; }
  const std::string& message() const noexcept { return _message; }
  // "code_name: message"
  std::string to_string() const;

 private:
  Code _code = Code::ok;
  std::string _message;
};

#define HCOMM_TRY(expr)                          \
  do {                                           \
    ::hcomm::Status _hcomm_st = (expr);          \
    if (!_hcomm_st.is_ok()) return _hcomm_st;    \
  } while (0)

}  // namespace hcomm
