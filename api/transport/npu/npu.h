// npu: this rank's NPU moves the bytes (docs/device-abi.md §9). One DMA queue
// per rank; COPY for put/get, REDUCE for accumulate (the device serialises
// REDUCE fabric-wide: element-wise atomic against other accumulates),
// FETCH_ADD / CMP_SWAP for fetch atomics, NOTIFY after the data for
// put_notify (it runs once every earlier descriptor of the queue completed).
// A same-host peer's host memory is DMA-mapped into our device from its memfd
// (advertised by shm); its HBM is reached over the node fabric (PEER_HBM).
// Keys are validated against the owner's live table (shm's node registry),
// and the device's translation table checks bounds and rights again.
#pragma once

#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "api/transport/shm/shm.h"
#include "api/transport/transport.h"
#include "common/barrier.h"
#include "common/range_alloc.h"
#include "driver/dma_memory.h"
#include "hal/npu/device.h"
#include "hal/npu/dma_queue.h"

namespace hcomm::api {

class NpuTransport final : public Transport {
 public:
  // Opens device `name` ("sim:N" or a PCI address).
  static Status open(const std::string& name, int rank, ShmTransport& node, std::unique_ptr<NpuTransport>* out);
  ~NpuTransport() override;

  TransportId id() const override { return TransportId::npu; }
  const Caps& caps() const override { return _caps; }
  bool reaches(int /*peer*/, bool same_host) const override { return same_host; }
  Status mem_add(hcomm_mem& m) override;
  void mem_remove(hcomm_mem& m) override;
  bool pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const override;
  Status import(hcomm_rkey& k, const uint8_t* sec, size_t len) override;
  Status unimport(hcomm_rkey& k) override;
  Status validate(const hcomm_rkey& k) const override { return _node.live(k.peer, k.h.slot, k.h.gen); }
  Status rma(const RmaOp& op, const std::shared_ptr<Request>& r) override;
  Status flush(int peer, const Deadline& dl) override;
  void progress() override;
  // Every descriptor on our queue completes (the device's, or lose()'s).
  bool finishes_alone() const override { return true; }
  // The device is gone (hcomm-sim exited or was killed, the ivshmem model
  // stopped) or was reset under us: hal::npu::Device::health.
  void check_health() override {
    if (_lost.is_ok())
      if (Status h = _dev->health(); !h) lose(h);
  }

  uint32_t fabric_index() const { return _dev->info().fabric_index; }
  // The device is a model in a process on this host (hcomm-sim over
  // vfio-user): its engines are threads on the CPUs the ranks spin on.
  bool software() const { return _software; }
  // The device, for the npu_roce transport (its network engine).
  hal::npu::Device& device() { return *_dev; }
  // Device memory (HCOMM_MEM_DEVICE): a first-fit HBM range, zeroed.
  Status alloc_hbm(hcomm_mem& m);

 private:
  NpuTransport(int rank, ShmTransport& node) : _rank(rank), _node(node) {}
  // The device is gone (its link hung up): fail what is pending, and every
  // later operation, with device_error naming it.
  void lose(const Status& why);
  // A wait's round: on hcomm-sim the engine may need this CPU (see
  // Context::spin_wait), so yield; on silicon, spin.
  void relax() const {
    if (_software) std::this_thread::yield();
    else cpu_relax();
  }

  int _rank;
  ShmTransport& _node;
  Caps _caps;
  std::unique_ptr<hal::npu::Device> _dev;
  std::unique_ptr<hal::npu::DmaQueue> _q;
  std::map<uint64_t, std::shared_ptr<Request>> _pending;  // by request id
  driver::DmaBuffer _scratch;  // fetch-atomic results
  hal::npu::Mapping _scratch_map;
  std::vector<uint32_t> _scratch_free;
  RangeAllocator _hbm;  // free device-memory offsets (4 KiB multiples)
  Status _lost;  // !ok: the device is gone
  bool _software = false;
};

}  // namespace hcomm::api
