// KvStore: a key-value store the job already runs (torch's c10d store, a
// PMIx server, ...), seen from the bootstrap. Bootstrap::from_store exchanges
// its blobs through one instead of opening a listener of its own: under
// torchrun / env:// torch's TCPStore already owns MASTER_PORT.
//
// Keys are plain strings; the bootstrap uses "hcomm/<job>/...". Values are
// bytes, at most kMaxValue. Not thread-safe: one thread drives a KvStore
// (the C callbacks promise no more than that either).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "api/include/hcomm/hcomm.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api {

class KvStore {
 public:
  // hcomm_kv_store_t promises its implementers values of at most 64 KiB.
  static constexpr size_t kMaxValue = 64 * 1024;

  virtual ~KvStore() = default;
  // Stores value under key, replacing any earlier value.
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // Waits until key exists, then returns its whole value. timeout when the
  // deadline passes first (an expired deadline still looks once).
  virtual Status get(const std::string& key, std::string* value, const Deadline& deadline) = 0;
};

// Wraps the C callbacks of hcomm.h (copied: `store` itself need not outlive
// the result, but store.arg must). get's return value 1 is timeout, any
// other nonzero is io_error; a value longer than the buffer is fetched again
// with a buffer of the reported length; one longer than kMaxValue is
// protocol_error. Null callbacks make every call invalid_argument.
std::unique_ptr<KvStore> kv_store_from_c(const hcomm_kv_store_t& store);

}  // namespace hcomm::api
