#include "api/wireup/run_dir.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>

namespace hcomm::api {

Status private_run_dir(std::string* dir) {
  std::string d = "/tmp/hcomm-" + std::to_string(::getuid());
  if (::mkdir(d.c_str(), 0700) != 0 && errno != EEXIST) return Status::from_errno(errno, "mkdir " + d);
  struct stat sb{};
  if (::lstat(d.c_str(), &sb) != 0) return Status::from_errno(errno, "lstat " + d);
  if (!S_ISDIR(sb.st_mode) || sb.st_uid != ::getuid() || (sb.st_mode & 0077) != 0)
    return Status::error(Code::access_denied,
                         "%s is not a private directory of uid %u (mode %o, owner %u)", d.c_str(),
                         static_cast<unsigned>(::getuid()), static_cast<unsigned>(sb.st_mode & 07777),
                         static_cast<unsigned>(sb.st_uid));
  *dir = std::move(d);
  return Status::ok();
}

std::string file_safe_job(const std::string& job_id) {
  std::string s;
  for (char c : job_id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    s += ok ? c : '_';
  }
  if (s.size() <= 40 && s == job_id) return s;
  // Lossy or long: keep a prefix and a hash of the original so that two
  // distinct ids never share a file (FNV-1a, 64 bit).
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : job_id) h = (h ^ c) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016" PRIx64, h);
  return s.substr(0, 23) + "-" + hex;
}

}  // namespace hcomm::api
