#include "api/wireup/kv_store.h"

namespace hcomm::api {

namespace {

class CStore final : public KvStore {
 public:
  explicit CStore(const hcomm_kv_store_t& s) : _s(s) {}

  Status set(const std::string& key, const std::string& value) override {
    if (_s.set == nullptr) return Status::error(Code::invalid_argument, "key-value store has no set callback");
    if (value.size() > kMaxValue)
      return Status::error(Code::invalid_argument, "store value for %s: %zu bytes exceeds %zu", key.c_str(),
                           value.size(), kMaxValue);
    int rc = _s.set(_s.arg, key.c_str(), value.data(), value.size());
    if (rc != 0) return Status::error(Code::io_error, "key-value store: set(\"%s\") failed (%d)", key.c_str(), rc);
    return Status::ok();
  }

  Status get(const std::string& key, std::string* value, const Deadline& dl) override {
    if (_s.get == nullptr) return Status::error(Code::invalid_argument, "key-value store has no get callback");
    // Most values are small: one call with a modest buffer; a longer one is
    // fetched again at its reported length (it exists by then, so the second
    // call returns at once). A value replaced in between by a longer one
    // makes us go round again, a bounded number of times.
    size_t cap = 4096;
    for (int attempt = 0; attempt < 4; ++attempt) {
      value->resize(cap);
      size_t len = 0;
      int rc = _s.get(_s.arg, key.c_str(), value->data(), cap, &len, dl.remaining_ms());
      if (rc == 1) {
        value->clear();
        return Status::error(Code::timeout, "key-value store: \"%s\" did not appear before the deadline",
                             key.c_str());
      }
      if (rc != 0) {
        value->clear();
        return Status::error(Code::io_error, "key-value store: get(\"%s\") failed (%d)", key.c_str(), rc);
      }
      if (len > kMaxValue) {
        value->clear();
        return Status::error(Code::protocol_error, "key-value store: \"%s\" holds %zu bytes, more than %zu",
                             key.c_str(), len, kMaxValue);
      }
      if (len <= cap) {
        value->resize(len);
        return Status::ok();
      }
      cap = len;
    }
    value->clear();
    return Status::error(Code::protocol_error, "key-value store: \"%s\" keeps changing length", key.c_str());
  }

 private:
  hcomm_kv_store_t _s;
};

}  // namespace

std::unique_ptr<KvStore> kv_store_from_c(const hcomm_kv_store_t& store) { return std::make_unique<CStore>(store); }

}  // namespace hcomm::api
