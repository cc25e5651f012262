// The NPU's network engine from the driver's side (docs/device-abi.md §15):
// the port (NetPort: MAC, address, counters, memory keys) and RC queue pairs
// (RdmaQp) whose rings live in DMA memory the device reaches through the
// ATT, beside DmaQueue, over the same driver Link (vfio-user, VFIO, ivshmem).
//
//   post_send() / post_recv()  write one work request into its ring in place
//                              and publish the tail (release) in the shadow
//                              block: no MMIO on the data path;
//   poll()                     reaps completions by phase bit and returns
//                              the CQ slots to the engine.
// Single producer, single consumer: one thread owns a queue pair at a time.
// The port's commands (keys, QP state) are serialised by the Device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"
#include "common/time.h"
#include "driver/dma_memory.h"
#include "hal/abi/rdma.h"
#include "hal/npu/device.h"

namespace hcomm::hal::npu {

namespace rdma = abi::rdma;

struct NetInfo {
  uint8_t mac[6] = {};
  uint32_t ip = 0;
  bool link_up = false;
  uint32_t max_mtu = 0, num_qp = 0, num_mr = 0;
  uint64_t counters[abi::reg::kNetCounterCount] = {};
};

// Where a queue pair connects to: the peer's QP, port address and PSN.
struct QpPeer {
  uint32_t qpn = 0;
  uint32_t ip = 0;
  uint8_t mac[6] = {};
  uint32_t psn = 0;  // the first PSN the peer sends (our rq_psn)
  uint8_t path_mtu = 0;  // the peer port's MTU code: the QP uses the smaller (0: options().path_mtu)
};

struct QpOptions {
  uint32_t sq_log2 = 7, rq_log2 = 7, cq_log2 = 8;
  uint8_t path_mtu = 5;       // 4096
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;
  uint8_t timeout = 14;       // 4.096 us * 2^14 = 67 ms
  uint8_t min_rnr_timer = 12; // 0.64 ms
  uint8_t max_rd_atomic = 16;
  uint32_t sq_psn = 0;        // the first PSN we send
};

class RdmaQp {
 public:
  ~RdmaQp();
  RdmaQp(const RdmaQp&) = delete;
  RdmaQp& operator=(const RdmaQp&) = delete;

  uint32_t qpn() const { return _qpn; }
  const QpOptions& options() const { return _opt; }
  // RESET -> INIT -> RTR -> RTS toward `peer`.
  Status connect(const QpPeer& peer);
  // Any state change (to ERR, say); a.state is the target.
  Status modify(const rdma::QpAttr& a);
  Status state(rdma::QpState* out);

  // ---- hot path ----
  [[nodiscard]] Code post_send(const rdma::SendWqe& w);  // no_resource when the ring is full
  [[nodiscard]] Code post_recv(const rdma::RecvWqe& w);
  uint32_t poll(std::span<rdma::Cqe> out);
  // Tools and tests: reaps until n completions arrived or the deadline passed.
  Status wait(uint32_t n, std::span<rdma::Cqe> out, const Deadline& deadline);
  uint32_t sq_free() const;

 private:
  friend class Device;
  RdmaQp(Device& dev, const QpOptions& o) : _dev(dev), _opt(o) {}
  Status init();

  Device& _dev;
  QpOptions _opt;
  driver::DmaBuffer _mem;  // SQ | RQ | CQ | shadow
  Mapping _map;
  uint32_t _qpn = 0;
  rdma::SendWqe* _sq = nullptr;
  rdma::RecvWqe* _rq = nullptr;
  rdma::Cqe* _cq = nullptr;
  rdma::QpShadow* _sh = nullptr;
  uint32_t _sq_tail = 0, _rq_tail = 0, _cq_head = 0;
};

}  // namespace hcomm::hal::npu
