// DmaQueue: one submission/completion ring pair of an NPU (docs/device-abi.md
// §7-§9), driven the way SPDK drives NVMe and DPDK dmadev drives DMA engines:
//
//   enqueue*()  writes one descriptor into the SQ ring in place (no staging
//               copy) and returns its ring index, or Code::no_resource when the
//               ring is full (back-pressure, not an error);
//   submit()    publishes the tail with release ordering, and rings the
//               doorbell only if the engine said it is going to sleep;
//   poll()      reaps completions (phase bit), returning per-descriptor status.
//
// Single producer, single consumer: one thread owns a queue at a time.
#pragma once

#include <cstdint>
#include <span>

#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"
#include "driver/dma_memory.h"
#include "driver/link.h"
#include "hal/abi/desc.h"
#include "hal/abi/ring.h"
#include "hal/npu/device.h"

namespace hcomm::hal::npu {

struct Completion {
  uint64_t user_data = 0;
  uint32_t index = 0;  // free-running SQ index
  abi::CqStatus status = abi::CqStatus::OK;
};

class DmaQueue {
 public:
  ~DmaQueue();
  DmaQueue(const DmaQueue&) = delete;
  DmaQueue& operator=(const DmaQueue&) = delete;

  uint32_t id() const { return _id; }
  uint32_t size() const { return _sq.size(); }
  // Descriptors enqueued but not yet reaped.
  uint32_t in_flight() const { return _tail - _reaped; }
  uint32_t free_slots() const { return size() - in_flight(); }

  // ---- hot path ----
  [[nodiscard]] Code enqueue(const abi::SqEntry& e, uint32_t* index = nullptr);
  [[nodiscard]] Code copy(uint64_t src, uint64_t dst, uint64_t len, uint64_t user_data, uint8_t flags = 0,
                          uint32_t* index = nullptr);
  [[nodiscard]] Code fill(uint64_t dst, uint64_t len, uint64_t pattern, uint64_t user_data, uint8_t flags = 0,
                          uint32_t* index = nullptr);
  [[nodiscard]] Code reduce(uint64_t src, uint64_t dst, uint64_t len, abi::DType dtype, abi::RedOp op,
                            uint64_t user_data, uint8_t flags = 0, uint32_t* index = nullptr);
  [[nodiscard]] Code notify(uint64_t dst, uint64_t value, uint64_t user_data, uint8_t flags = 0,
                            uint32_t* index = nullptr);
  [[nodiscard]] Code nop(uint64_t user_data, uint8_t flags = 0, uint32_t* index = nullptr);
  // Fetch atomics (cap::ATOMIC): the old value of *dst lands at `result`.
  [[nodiscard]] Code fetch_add(uint64_t dst, uint64_t result, uint64_t add, uint64_t user_data, uint8_t flags = 0,
                               uint32_t* index = nullptr);
  [[nodiscard]] Code cmp_swap(uint64_t dst, uint64_t result, uint64_t compare, uint64_t swap, uint64_t user_data,
                              uint8_t flags = 0, uint32_t* index = nullptr);
  void submit();
  // Reap up to out.size() completions; returns how many.
  uint32_t poll(std::span<Completion> out);

  // Wait until at least one completion is available or the deadline passes
  // (Code::timeout). Spins briefly, then sleeps on the MSI-X eventfd (when the
  // queue has interrupts) or in short naps.
  [[nodiscard]] Code wait(const Deadline& deadline);

  // Convenience for tests and tools: submit, then reap until every in-flight
  // descriptor completed; the first non-OK status is returned in *first_error.
  Status drain(const Deadline& deadline, abi::CqStatus* first_error = nullptr);

  // Doorbells actually rung (wake-up suppression skips the rest).
  uint64_t doorbells() const { return _doorbells; }
  // MSI-X interrupts signalled to this queue so far (0 without interrupts),
  // including ones no wait() had to sleep for. Diagnostics: it drains the
  // queue's eventfd.
  uint64_t interrupts();

 private:
  friend class Device;
  DmaQueue(Device& dev, uint32_t id) : _dev(dev), _id(id) {}
  Status init(uint32_t log2, bool interrupts);
  void shutdown();

  Device& _dev;
  uint32_t _id;
  driver::DmaBuffer _mem;  // SQ | CQ | shadow, one buffer
  Mapping _map;
  abi::Ring<abi::SqEntry> _sq;
  abi::Ring<abi::CqEntry> _cq;
  abi::QueueShadow* _shadow = nullptr;
  driver::Doorbell _doorbell;
  UniqueFd _irq;
  bool _enabled = false;
  uint32_t _tail = 0;       // next SQ index to write (driver-owned)
  uint32_t _published = 0;  // last tail stored to the shadow
  uint32_t _cq_head = 0;    // next CQ index to read (driver-owned)
  uint32_t _reaped = 0;     // completions reaped
  uint64_t _doorbells = 0;
  uint64_t _interrupts = 0;
};

}  // namespace hcomm::hal::npu
