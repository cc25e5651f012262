// Remote keys between the two ranks of a pair, for tests that run inside
// run_ranks (tests/support/ranks.h): each packs the key of its `m`, they swap
// them over a sendrecv, and each imports the other's.
#pragma once

#include <hcomm/hcomm.h>

#include "tests/support/ranks.h"

namespace hcomm::test {

inline hcomm_rkey_t* swap_keys(hcomm_context_t* ctx, int peer, hcomm_mem_t* m, uint64_t tag, int timeout_ms) {
  uint8_t mine[HCOMM_RKEY_MAX], theirs[HCOMM_RKEY_MAX];
  size_t len = sizeof mine;
  RCHECK_OK(hcomm_mem_rkey_pack(m, mine, &len));
  hcomm_recv_info_t info;
  RCHECK_OK(hcomm_sendrecv(ctx, peer, mine, len, tag, peer, theirs, sizeof theirs, tag, HCOMM_TAG_MASK_ALL, &info,
                           timeout_ms));
  hcomm_rkey_t* k = nullptr;
  RCHECK_OK(hcomm_rkey_import(ctx, peer, theirs, info.length, &k));
  return k;
}

}  // namespace hcomm::test
