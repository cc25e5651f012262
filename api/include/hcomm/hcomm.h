/*
 * hcomm: point-to-point communication for accelerators.
 *
 * Two-sided Send/Recv/SendRecv with 64-bit tags; one-sided Put/Get/
 * Accumulate, put-with-notify and fetch atomics into registered memory that
 * peers address with remote keys; flush and fence. Every handle is opaque;
 * every call returns an hcomm_status_t; every wait takes a timeout.
 *
 * Threading: a context may be used from several threads; calls on one
 * context are serialised internally, except one-sided calls on a synchronous
 * lane (shm, cma: same host), which run side by side without the context's
 * lock (docs/api.md, "Threads").
 *
 * ABI: this header is versioned (HCOMM_API_VERSION). Structs passed in carry
 * their own size so later versions can grow them.
 */
#ifndef HCOMM_HCOMM_H
#define HCOMM_HCOMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HCOMM_API_VERSION_MAJOR 0
#define HCOMM_API_VERSION_MINOR 3
#define HCOMM_API_VERSION ((HCOMM_API_VERSION_MAJOR << 16) | HCOMM_API_VERSION_MINOR)

/* The library's version (major << 16 | minor). */
uint32_t hcomm_api_version(void);

typedef enum hcomm_status {
  HCOMM_OK = 0,
  HCOMM_IN_PROGRESS = 1,          /* request not finished yet */
  HCOMM_ERR_NO_RESOURCE = 2,      /* out of slots/keys/memory; retry later */
  HCOMM_ERR_INVALID = 3,          /* bad argument: null, size, unregistered buffer, dtype */
  HCOMM_ERR_NOT_FOUND = 4,        /* no such device / peer */
  HCOMM_ERR_IO = 5,               /* a system call failed */
  HCOMM_ERR_PROTOCOL = 6,         /* malformed message or key from a peer */
  HCOMM_ERR_TIMEOUT = 7,          /* the timeout passed */
  HCOMM_ERR_DEVICE = 8,           /* the device reported an error */
  HCOMM_ERR_ACCESS = 9,           /* wrong, revoked or foreign remote key; missing right */
  HCOMM_ERR_OUT_OF_RANGE = 10,    /* outside the registered / keyed range */
  HCOMM_ERR_UNSUPPORTED = 11,     /* the engine cannot do this */
  HCOMM_ERR_PEER_FAILURE = 12,    /* the peer exited or was killed */
  HCOMM_ERR_CLOSED = 13,          /* the context is finalized */
  HCOMM_ERR_TRUNCATED = 14,       /* the message was longer than the receive buffer */
  HCOMM_ERR_CANCELLED = 15,       /* withdrawn (hcomm_request_cancel, or a blocking call's timeout) */
} hcomm_status_t;

/* Static description of a status ("peer failure"). */
const char* hcomm_strerror(hcomm_status_t status);
/* The detailed message of the last failed call on this thread ("" if none). */
const char* hcomm_last_error(void);

typedef struct hcomm_context hcomm_context_t;
typedef struct hcomm_mem hcomm_mem_t;
typedef struct hcomm_rkey hcomm_rkey_t;
typedef struct hcomm_request hcomm_request_t;

typedef enum hcomm_engine {
  HCOMM_ENGINE_AUTO = 0, /* NPU if one is reachable, else host; env HCOMM_ENGINE=host|npu overrides */
  HCOMM_ENGINE_HOST = 1, /* host memory on one host: memcpy into mapped peer memory */
  HCOMM_ENGINE_NPU = 2,  /* the NPU's DMA engines (hcomm-sim or a VFIO device) */
} hcomm_engine_t;

/* A key-value store the job already has (torch's c10d store, a PMIx server, ...). With it,
 * hcomm_init starts from config.rank / config.size and exchanges its bootstrap data through the
 * store instead of opening a rendezvous listener of its own. Keys are NUL-terminated strings that
 * hcomm prefixes with "hcomm/"; values are at most 64 KiB. Both callbacks may be called from any
 * thread that calls into the context, never concurrently. */
typedef struct hcomm_kv_store {
  void* arg;
  /* Stores value under key (replacing). Returns 0 on success. */
  int (*set)(void* arg, const char* key, const void* value, size_t len);
  /* Waits at most timeout_ms until key exists, then copies min(len, cap) bytes of its value into
   * value and stores the full length in *len. Returns 0 on success, 1 if the key did not appear
   * within timeout_ms, any other value on failure. */
  int (*get)(void* arg, const char* key, void* value, size_t cap, size_t* len, int timeout_ms);
} hcomm_kv_store_t;

typedef struct hcomm_config {
  size_t struct_size;       /* sizeof(hcomm_config_t) */
  hcomm_engine_t engine;
  int bootstrap_timeout_ms; /* default 30000; env HCOMM_BOOTSTRAP_TIMEOUT_MS (100..3600000) overrides it */
  const char* device;       /* NPU engine: "sim:N" or a PCI address; NULL = sim:<local rank> */
  int peer_check_ms;        /* how often progress polls peers for failure (default 1; env HCOMM_PEER_CHECK_MS);
                               a peer that exits fails its requests within about this long */
  /* --- API 0.2 --- */
  int rank;                 /* with size > 0 and store: this process's rank (default -1: from the environment) */
  int size;                 /* world size (default 0: from the environment) */
  int local_rank;           /* rank among the job's processes on this host (default -1: from the environment, else 0) */
  const hcomm_kv_store_t* store; /* with rank/size: bootstrap through this store (the struct is copied; the
                               callbacks and arg must stay valid until hcomm_finalize: barriers use them) */
  const char* job_id;       /* with store: names the job (ranks of one job pass the same; NULL: rank 0 draws a
                               random id and publishes it in the store under "hcomm/job-id") */
  const char* transports;   /* comma-separated transports allowed, e.g. "verbs" or "shm,cma"; a forced transport is
                               never silently replaced. NULL: env HCOMM_TRANSPORTS, else all that are present */
} hcomm_config_t;

void hcomm_config_init(hcomm_config_t* config);

/* Joins the job described by the environment (torchrun variables, Open MPI's
 * mpirun, hcomm-run; none = a single rank). Collective. */
hcomm_status_t hcomm_init(const hcomm_config_t* config, hcomm_context_t** ctx);
/* Collective; completes or fails every outstanding request, frees ctx and
 * every memory, key and request handle made from it (their handles are
 * invalid afterwards: release what you want released first). */
hcomm_status_t hcomm_finalize(hcomm_context_t* ctx);

int hcomm_rank(const hcomm_context_t* ctx);
int hcomm_size(const hcomm_context_t* ctx);
/* "host" or "npu" */
const char* hcomm_engine_name(const hcomm_context_t* ctx);
/* The transports serving `peer`, comma-separated, messaging transport first: e.g. "shm,cma" (same
 * host, host engine), "shm,npu,cma" (NPU engine), "verbs" (another host, or HCOMM_TRANSPORTS=verbs).
 * For this rank itself: the lanes that reach its own memory. NULL for a rank outside the job. */
const char* hcomm_peer_transport(const hcomm_context_t* ctx, int peer);
/* Collective barrier. */
hcomm_status_t hcomm_barrier(hcomm_context_t* ctx, int timeout_ms);

/* ---- memory ---------------------------------------------------------------- */

#define HCOMM_MEM_HOST 0u   /* host memory, shareable with peers */
#define HCOMM_MEM_DEVICE 1u /* NPU memory (HBM); NPU engine only */

#define HCOMM_ACCESS_REMOTE_READ 1u
#define HCOMM_ACCESS_REMOTE_WRITE 2u
#define HCOMM_ACCESS_REMOTE_ATOMIC 4u
#define HCOMM_ACCESS_ALL 7u

/* Allocates registered memory (zeroed). */
hcomm_status_t hcomm_mem_alloc(hcomm_context_t* ctx, size_t size, unsigned kind, unsigned access,
                               hcomm_mem_t** mem);
/* Registers an existing host buffer. */
hcomm_status_t hcomm_mem_register(hcomm_context_t* ctx, void* addr, size_t size, unsigned access,
                                  hcomm_mem_t** mem);
/* Revokes every key of mem (peers' later accesses fail with HCOMM_ERR_ACCESS),
 * then frees / deregisters it. */
hcomm_status_t hcomm_mem_release(hcomm_mem_t* mem);
/* CPU address of the memory (device memory: its mapping through the HBM aperture). */
void* hcomm_mem_ptr(const hcomm_mem_t* mem);
size_t hcomm_mem_size(const hcomm_mem_t* mem);

#define HCOMM_RKEY_MAX 128
/* Serialises a remote key for mem (opaque, versioned, at most HCOMM_RKEY_MAX
 * bytes) into buf; *len is in: capacity, out: bytes written. */
hcomm_status_t hcomm_mem_rkey_pack(const hcomm_mem_t* mem, void* buf, size_t* len);
/* Imports a key that `peer` packed. Validated against the peer's live
 * registration table: a forged, stale or revoked key is HCOMM_ERR_ACCESS. */
hcomm_status_t hcomm_rkey_import(hcomm_context_t* ctx, int peer, const void* buf, size_t len,
                                 hcomm_rkey_t** rkey);
size_t hcomm_rkey_size(const hcomm_rkey_t* rkey);
hcomm_status_t hcomm_rkey_release(hcomm_rkey_t* rkey);

/* ---- requests ------------------------------------------------------------------ */

/* HCOMM_OK when done (and *done = 1), HCOMM_IN_PROGRESS (and *done = 0), or
 * the request's error. Drives progress. */
hcomm_status_t hcomm_test(hcomm_request_t* req, int* done);
/* Waits up to timeout_ms (< 0: no limit is not allowed; use a large value). */
hcomm_status_t hcomm_wait(hcomm_request_t* req, int timeout_ms);
/* The cancel rule. Cancels a pending request and returns once the request is
 * done and nothing touches its buffers any more: either it was withdrawn
 * (status HCOMM_ERR_CANCELLED; a receive is unposted, an unmatched send is
 * retracted and the peer never sees it) or it had gone too far and ran to its
 * end (its own status). A transfer in flight (a rendezvous the peer is
 * reading, an RMA on an asynchronous lane) is waited for, at most the cancel
 * bound: 1 s + peer_check_ms + the transports' own failure bound (verbs: ACK
 * timeout x retries). Past it, the peer that holds it up is declared failed,
 * which stops its transports touching this rank's memory, and the request
 * fails with HCOMM_ERR_PEER_FAILURE. Returns the request's final status.
 * Blocking calls follow the same rule when their timeout passes: they return
 * HCOMM_ERR_TIMEOUT only once the operation is withdrawn, else the status it
 * ended with. */
hcomm_status_t hcomm_request_cancel(hcomm_request_t* req);
/* Drops the handle; a pending operation goes on (its buffers must stay valid
 * until it completes). Safe after hcomm_finalize. */
void hcomm_request_free(hcomm_request_t* req);
/* Waits for every request of reqs[0, count) under one timeout, as
 * MPI_Waitall does (NULL entries are skipped). Each request that finished is
 * freed and its entry set to NULL; statuses (NULL: not wanted) receives each
 * entry's status (HCOMM_OK for a NULL entry, HCOMM_IN_PROGRESS for one still
 * pending). Returns HCOMM_ERR_TIMEOUT when some are still pending at the
 * deadline (they stay in the array, the caller's to wait for, cancel or
 * free), else the first failed request's status (hcomm_last_error names its
 * index), else HCOMM_OK. A handle that is not live (already freed) or that
 * appears twice refuses the call with HCOMM_ERR_INVALID before anything is
 * waited for or freed. */
hcomm_status_t hcomm_wait_all(hcomm_request_t** reqs, size_t count, hcomm_status_t* statuses,
                              int timeout_ms);
/* Drives progress once (optional: every call does). */
hcomm_status_t hcomm_progress(hcomm_context_t* ctx);

/* ---- one-sided (the target takes no part) ---------------------------------------- */

typedef enum hcomm_dtype {
  HCOMM_INT8 = 0, HCOMM_INT16 = 1, HCOMM_INT32 = 2, HCOMM_INT64 = 3,
  HCOMM_UINT8 = 4, HCOMM_UINT16 = 5, HCOMM_UINT32 = 6, HCOMM_UINT64 = 7,
  HCOMM_FP16 = 8, HCOMM_BF16 = 9, HCOMM_FP32 = 10, HCOMM_FP64 = 11,
} hcomm_dtype_t;
size_t hcomm_dtype_size(hcomm_dtype_t dtype);

typedef enum hcomm_op { HCOMM_SUM = 0, HCOMM_PROD = 1, HCOMM_MAX = 2, HCOMM_MIN = 3 } hcomm_op_t;

/* `local` must lie inside memory registered on this context. The remote range
 * is [remote_offset, remote_offset + len) of the key's memory. Blocking forms
 * return once the operation completed at the target. */
hcomm_status_t hcomm_put(hcomm_context_t* ctx, const void* local, size_t len, hcomm_rkey_t* rkey,
                         uint64_t remote_offset, int timeout_ms);
hcomm_status_t hcomm_get(hcomm_context_t* ctx, void* local, size_t len, hcomm_rkey_t* rkey,
                         uint64_t remote_offset, int timeout_ms);
/* remote[i] = remote[i] op local[i], element-wise atomic against other accumulates. */
hcomm_status_t hcomm_accumulate(hcomm_context_t* ctx, const void* local, size_t count, hcomm_dtype_t dtype,
                                hcomm_op_t op, hcomm_rkey_t* rkey, uint64_t remote_offset, int timeout_ms);
/* Put, then store `value` into the 8-byte word at notify_offset of notify_rkey
 * once the data is visible at the target. */
hcomm_status_t hcomm_put_notify(hcomm_context_t* ctx, const void* local, size_t len, hcomm_rkey_t* rkey,
                                uint64_t remote_offset, hcomm_rkey_t* notify_rkey, uint64_t notify_offset,
                                uint64_t value, int timeout_ms);
/* Target side: waits until the 8-byte word at offset of mem is >= value. A peer that fails during
 * the wait ends it with HCOMM_ERR_PEER_FAILURE (the word may never come); calling again keeps waiting. */
hcomm_status_t hcomm_notify_wait(hcomm_context_t* ctx, hcomm_mem_t* mem, uint64_t offset, uint64_t value,
                                 int timeout_ms);
hcomm_status_t hcomm_fetch_add(hcomm_context_t* ctx, hcomm_rkey_t* rkey, uint64_t remote_offset, uint64_t add,
                               uint64_t* old_value, int timeout_ms);
hcomm_status_t hcomm_compare_swap(hcomm_context_t* ctx, hcomm_rkey_t* rkey, uint64_t remote_offset,
                                  uint64_t compare, uint64_t swap, uint64_t* old_value, int timeout_ms);

/* Nonblocking forms: the request completes when the operation completed at the target. An
 * operation that completed before the call returned (a synchronous lane: shm, cma) gets a shared,
 * already completed handle: wait, test, cancel and free work on it as on any (free is a no-op). */
hcomm_status_t hcomm_iput(hcomm_context_t* ctx, const void* local, size_t len, hcomm_rkey_t* rkey,
                          uint64_t remote_offset, hcomm_request_t** req);
hcomm_status_t hcomm_iget(hcomm_context_t* ctx, void* local, size_t len, hcomm_rkey_t* rkey,
                          uint64_t remote_offset, hcomm_request_t** req);
hcomm_status_t hcomm_iaccumulate(hcomm_context_t* ctx, const void* local, size_t count, hcomm_dtype_t dtype,
                                 hcomm_op_t op, hcomm_rkey_t* rkey, uint64_t remote_offset,
                                 hcomm_request_t** req);
hcomm_status_t hcomm_iput_notify(hcomm_context_t* ctx, const void* local, size_t len, hcomm_rkey_t* rkey,
                                 uint64_t remote_offset, hcomm_rkey_t* notify_rkey, uint64_t notify_offset,
                                 uint64_t value, hcomm_request_t** req);
/* *old_value is written when the request completes; it must stay valid until then. */
hcomm_status_t hcomm_ifetch_add(hcomm_context_t* ctx, hcomm_rkey_t* rkey, uint64_t remote_offset, uint64_t add,
                                uint64_t* old_value, hcomm_request_t** req);
hcomm_status_t hcomm_icompare_swap(hcomm_context_t* ctx, hcomm_rkey_t* rkey, uint64_t remote_offset,
                                   uint64_t compare, uint64_t swap, uint64_t* old_value, hcomm_request_t** req);

/* Nonblocking with implicit completion (OpenSHMEM put_nbi, ucp_put_nbi): no request. The
 * operation is complete at the target once a later hcomm_flush (to its peer, or -1) returned
 * HCOMM_OK; the local buffer must stay valid (put: unchanged) until then. An error found when the
 * call is made is returned at once; one the operation meets later is returned by that flush. On a
 * synchronous lane (shm, cma) the operation is complete when the call returns. */
hcomm_status_t hcomm_put_nbi(hcomm_context_t* ctx, const void* local, size_t len, hcomm_rkey_t* rkey,
                             uint64_t remote_offset);
hcomm_status_t hcomm_get_nbi(hcomm_context_t* ctx, void* local, size_t len, hcomm_rkey_t* rkey,
                             uint64_t remote_offset);

/* Waits until every one-sided operation issued on ctx (peer = -1) or to
 * `peer` completed at its target; reports the first failure of an implicit
 * (_nbi) operation to those peers since the last flush that covered them. */
hcomm_status_t hcomm_flush(hcomm_context_t* ctx, int peer, int timeout_ms);
/* Orders: every one-sided operation issued after the fence starts after every
 * one issued before it completed. */
hcomm_status_t hcomm_fence(hcomm_context_t* ctx);

/* ---- two-sided ----------------------------------------------------------------- */

#define HCOMM_ANY_SOURCE (-1)
#define HCOMM_TAG_MASK_ALL UINT64_MAX

typedef struct hcomm_recv_info {
  int source;
  uint64_t tag;
  size_t length; /* bytes the sender sent (may exceed the buffer: HCOMM_ERR_TRUNCATED) */
} hcomm_recv_info_t;

/* A receive matches a message when (msg_tag & tag_mask) == (tag & tag_mask)
 * and the source matches (or is HCOMM_ANY_SOURCE). Messages between one pair
 * with matching tags are received in the order they were sent. */
hcomm_status_t hcomm_send(hcomm_context_t* ctx, int dest, const void* buf, size_t len, uint64_t tag,
                          int timeout_ms);
hcomm_status_t hcomm_recv(hcomm_context_t* ctx, int source, void* buf, size_t len, uint64_t tag,
                          uint64_t tag_mask, hcomm_recv_info_t* info, int timeout_ms);
hcomm_status_t hcomm_isend(hcomm_context_t* ctx, int dest, const void* buf, size_t len, uint64_t tag,
                           hcomm_request_t** req);
hcomm_status_t hcomm_irecv(hcomm_context_t* ctx, int source, void* buf, size_t len, uint64_t tag,
                           uint64_t tag_mask, hcomm_request_t** req);
/* Info of a completed receive request. */
hcomm_status_t hcomm_request_recv_info(const hcomm_request_t* req, hcomm_recv_info_t* info);
/* Is a matching message waiting? *found = 1 and info filled if so. Nonblocking. */
hcomm_status_t hcomm_probe(hcomm_context_t* ctx, int source, uint64_t tag, uint64_t tag_mask, int* found,
                           hcomm_recv_info_t* info);
/* Posts the receive and the send, then waits for both: a ring of ranks that
 * each sendrecv to the next cannot deadlock. */
hcomm_status_t hcomm_sendrecv(hcomm_context_t* ctx, int dest, const void* sbuf, size_t slen, uint64_t stag,
                              int source, void* rbuf, size_t rlen, uint64_t rtag, uint64_t rtag_mask,
                              hcomm_recv_info_t* info, int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* HCOMM_HCOMM_H */
