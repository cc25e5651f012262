// cma: memory a same-host peer merely registered (hcomm_mem_register), reached
// with process_vm_readv / writev: the kernel copies once, straight between the
// two address spaces. Also the zero-copy rendezvous pull from a sender's
// buffer that is not shareable hcomm memory (read_raw).
//
// Atomicity: peers reach the memory through the kernel, never by CPU atomics
// on a shared mapping, so every rank (the owner included, whose key for its
// own registration lands on this lane too) serialises accumulates and fetch
// atomics on the owner's lock (the shm node registry).
#pragma once

#include <sys/types.h>

#include "api/transport/shm/shm.h"
#include "api/transport/transport.h"

namespace hcomm::api {

// process_vm_readv (write = false) / writev of all of [remote, remote+len)
// in process pid: peer_failure if it is gone.
Status cma_copy(pid_t pid, void* local, uint64_t remote, size_t len, bool write);

class CmaTransport final : public Transport {
 public:
  CmaTransport(int rank, ShmTransport& node);

  TransportId id() const override { return TransportId::cma; }
  const Caps& caps() const override { return _caps; }
  bool reaches(int /*peer*/, bool same_host) const override { return same_host; }
  bool pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const override;
  Status import(hcomm_rkey& k, const uint8_t* sec, size_t len) override;
  Status validate(const hcomm_rkey& k) const override { return _node.live(k.peer, k.h.slot, k.h.gen); }
  Status rma(const RmaOp& op, const std::shared_ptr<Request>& r) override;
  Status read_raw(int peer, void* local, uint64_t addr, uint32_t rkey, size_t len,
                  const std::shared_ptr<Request>& g) override;

 private:
  // Read or write [off, off+len) of the key's memory from this CPU.
  Status rw(const hcomm_rkey& k, uint64_t off, void* buf, size_t len, bool write);

  int _rank;
  ShmTransport& _node;
  Caps _caps;
};

}  // namespace hcomm::api
