// Environment variables as settings: unset and empty are the same, and a
// number outside its range is a clear invalid_argument naming the variable.
#pragma once

#include <cstdlib>

#include "common/status.h"

namespace hcomm {

// The variable's value, or null when it is unset or empty.
inline const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// *out = the variable as a decimal integer in [lo, hi]; unchanged when unset.
inline Status env_int(const char* name, long lo, long hi, long* out) {
  const char* v = env(name);
  if (v == nullptr) return Status::ok();
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi)
    return Status::error(Code::invalid_argument, "%s='%s': use %ld..%ld", name, v, lo, hi);
  *out = x;
  return Status::ok();
}

}  // namespace hcomm
