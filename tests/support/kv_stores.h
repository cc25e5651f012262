// Key-value stores for the store bootstrap's tests, behind the C interface
// of hcomm.h (hcomm_kv_store_t), so that every test also goes through
// kv_store_from_c:
//  - MemStore: in-process (threads), with injected failures;
//  - DirStore: one file per key in a directory, for ranks in separate
//    processes (set = write a temp file, then rename; get = poll).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "api/include/hcomm/hcomm.h"

namespace hcomm::test {

class MemStore {
 public:
  hcomm_kv_store_t c() { return {this, &MemStore::c_set, &MemStore::c_get}; }

  // Failure injection: the next set/get whose key contains `match` returns rc.
  void fail_set(const std::string& match, int rc) {
    std::lock_guard<std::mutex> g(_mu);
    _set_fail = {match, rc};
  }
  void fail_get(const std::string& match, int rc) {
    std::lock_guard<std::mutex> g(_mu);
    _get_fail = {match, rc};
  }
  bool has(const std::string& key) {
    std::lock_guard<std::mutex> g(_mu);
    return _kv.count(key) != 0;
  }
  size_t keys() {
    std::lock_guard<std::mutex> g(_mu);
    return _kv.size();
  }
  std::string first_key() {
    std::lock_guard<std::mutex> g(_mu);
    return _kv.empty() ? std::string() : _kv.begin()->first;
  }

 private:
  static int c_set(void* arg, const char* key, const void* value, size_t len) {
    auto* s = static_cast<MemStore*>(arg);
    std::lock_guard<std::mutex> g(s->_mu);
    if (!s->_set_fail.first.empty() && std::strstr(key, s->_set_fail.first.c_str()) != nullptr)
      return std::exchange(s->_set_fail, {}).second;
    s->_kv[key].assign(static_cast<const char*>(value), len);
    s->_cv.notify_all();
    return 0;
  }
  static int c_get(void* arg, const char* key, void* value, size_t cap, size_t* len, int timeout_ms) {
    auto* s = static_cast<MemStore*>(arg);
    std::unique_lock<std::mutex> g(s->_mu);
    if (!s->_get_fail.first.empty() && std::strstr(key, s->_get_fail.first.c_str()) != nullptr)
      return std::exchange(s->_get_fail, {}).second;
    if (!s->_cv.wait_for(g, std::chrono::milliseconds(timeout_ms), [&] { return s->_kv.count(key) != 0; })) return 1;
    const std::string& v = s->_kv[key];
    std::memcpy(value, v.data(), std::min(cap, v.size()));
    *len = v.size();
    return 0;
  }

  std::mutex _mu;
  std::condition_variable _cv;
  std::map<std::string, std::string> _kv;
  std::pair<std::string, int> _set_fail, _get_fail;
};

class DirStore {
 public:
  explicit DirStore(std::string dir) : _dir(std::move(dir)) {}
  hcomm_kv_store_t c() { return {this, &DirStore::c_set, &DirStore::c_get}; }

 private:
  std::string path(const char* key) const {
    std::string p = _dir + "/";
    for (const char* k = key; *k != '\0'; ++k) p += *k == '/' ? '#' : *k;
    return p;
  }
  static int c_set(void* arg, const char* key, const void* value, size_t len) {
    auto* s = static_cast<DirStore*>(arg);
    std::string p = s->path(key), tmp = p + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(static_cast<const char*>(value), static_cast<std::streamsize>(len));
      if (!out) return 2;
    }
    return std::rename(tmp.c_str(), p.c_str()) == 0 ? 0 : 3;
  }
  static int c_get(void* arg, const char* key, void* value, size_t cap, size_t* len, int timeout_ms) {
    auto* s = static_cast<DirStore*>(arg);
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      std::ifstream in(s->path(key), std::ios::binary);
      if (in) {
        std::stringstream ss;
        ss << in.rdbuf();
        std::string v = ss.str();
        std::memcpy(value, v.data(), std::min(cap, v.size()));
        *len = v.size();
        return 0;
      }
      if (std::chrono::steady_clock::now() >= until) return 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  std::string _dir;
};

}  // namespace hcomm::test
