// The per-user directory under /tmp where bootstrap and mesh keep their
// rendezvous files (port files, listening sockets). Internal to api/.
#pragma once

#include <string>

#include "common/status.h"

namespace hcomm::api {

// /tmp/hcomm-<uid>, created 0700 if missing. Fails with access_denied when
// the path exists but is not a directory owned by us (a symlink included):
// another user must not be able to plant our sockets or port files.
Status private_run_dir(std::string* dir);
// A job id reduced to [A-Za-z0-9._-] and at most 40 characters (longer ids
// keep a 16-hex-digit hash of the whole id), safe inside a file name.
std::string file_safe_job(const std::string& job_id);

}  // namespace hcomm::api
