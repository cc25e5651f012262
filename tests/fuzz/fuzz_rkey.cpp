// Remote-key import (Context::rkey_import, api/mem/memory.cpp) on arbitrary
// bytes and on mutations of real packed keys: the header, the per-transport
// sections, and the check against the owner's live registration table.
// One single-rank context (no launch environment: one rank, host engine)
// lives for the whole run; its own memory plays the peer's. Three
// registrations back it: hcomm memory (its key has shm + cma sections), a
// registered user buffer (cma only), and the local buffer gets read into.
// Whatever import accepts must allow only in-bounds access: a get of
// min(8, size) bytes at offset 0 returns OK or a clean error, one byte at
// offset size is refused, and the key releases. Nothing may crash or leak
// (ASan, LeakSanitizer).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "api/include/hcomm/hcomm.h"
#include "tests/fuzz/fuzz.h"

namespace {

struct World {
  hcomm_context_t* ctx = nullptr;
  hcomm_mem_t* alloc = nullptr;  // hcomm memory
  hcomm_mem_t* user = nullptr;   // a registered user buffer
  hcomm_mem_t* local = nullptr;  // where gets land
  alignas(64) uint8_t user_buf[24] = {};
};
World* g_world = nullptr;

[[noreturn]] void die(const char* what, hcomm_status_t st) {
  std::fprintf(stderr, "fuzz_rkey: %s: %s\n", what, hcomm_strerror(st));
  std::abort();
}

void check(const char* what, hcomm_status_t st) {
  if (st != HCOMM_OK) die(what, st);
}

// Finalized at exit, so that LeakSanitizer reports what import and release
// left behind, not the context.
void teardown() {
  if (g_world == nullptr) return;
  check("hcomm_finalize", hcomm_finalize(g_world->ctx));
  delete g_world;
  g_world = nullptr;
}

// Made on first use: the standalone driver asks for seeds first, libFuzzer
// runs the target first.
World& world() {
  if (g_world != nullptr) return *g_world;
  auto* w = new World;
  hcomm_config_t cfg;
  hcomm_config_init(&cfg);
  cfg.engine = HCOMM_ENGINE_HOST;
  check("hcomm_init", hcomm_init(&cfg, &w->ctx));
  if (hcomm_size(w->ctx) != 1) die("hcomm_init: more than one rank (a launch environment is set)", HCOMM_OK);
  check("hcomm_mem_alloc", hcomm_mem_alloc(w->ctx, 4096, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w->alloc));
  check("hcomm_mem_register",
        hcomm_mem_register(w->ctx, w->user_buf, sizeof w->user_buf, HCOMM_ACCESS_REMOTE_READ, &w->user));
  check("hcomm_mem_alloc(local)", hcomm_mem_alloc(w->ctx, 64, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w->local));
  g_world = w;
  std::atexit(teardown);
  return *w;
}

std::string packed(const hcomm_mem_t* m) {
  uint8_t buf[HCOMM_RKEY_MAX];
  size_t len = sizeof buf;
  check("hcomm_mem_rkey_pack", hcomm_mem_rkey_pack(m, buf, &len));
  return std::string(reinterpret_cast<const char*>(buf), len);
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  World& w = world();
  std::string a = packed(w.alloc), u = packed(w.user), l = packed(w.local);
  // The hcomm memory's key with its sections swapped and with only its cma
  // section (header byte 7 counts the sections).
  std::string swapped = a.substr(0, 48) + a.substr(a.size() - 2) + a.substr(48, a.size() - 50);
  std::string cma_only = a.substr(0, 48) + a.substr(a.size() - 2);
  cma_only[7] = 1;
  return {a, u, l, swapped, cma_only};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  hcomm_rkey_t* k = nullptr;
  if (hcomm_rkey_import(w.ctx, 0, data, size, &k) != HCOMM_OK) return 0;
  const size_t ksize = hcomm_rkey_size(k);
  auto* dst = static_cast<uint8_t*>(hcomm_mem_ptr(w.local));
  // Only the live registrations' sizes can pass the table check.
  if (ksize != hcomm_mem_size(w.alloc) && ksize != hcomm_mem_size(w.user) && ksize != hcomm_mem_size(w.local))
    die("imported a key whose size matches no registration", HCOMM_OK);
  hcomm_status_t st = hcomm_get(w.ctx, dst, std::min<size_t>(8, ksize), k, 0, 1000);
  if (st != HCOMM_OK && st != HCOMM_ERR_ACCESS) die("hcomm_get of an accepted key", st);
  st = hcomm_get(w.ctx, dst, 1, k, ksize, 1000);
  if (st != HCOMM_ERR_OUT_OF_RANGE) die("hcomm_get one byte past an accepted key", st);
  check("hcomm_rkey_release", hcomm_rkey_release(k));
  return 0;
}
