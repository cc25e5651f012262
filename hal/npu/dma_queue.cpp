#include "hal/npu/dma_queue.h"

#include "common/barrier.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>

namespace hcomm::hal::npu {

namespace reg = abi::reg;

namespace {
constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }
}  // namespace

Status DmaQueue::init(uint32_t log2, bool interrupts) {
  const uint64_t n = 1ull << log2;
  const uint64_t sq_bytes = n * sizeof(abi::SqEntry);
  const uint64_t cq_off = sq_bytes;
  const uint64_t cq_bytes = align_up(n * sizeof(abi::CqEntry), 64);
  const uint64_t sh_off = cq_off + cq_bytes;
  const uint64_t total = align_up(sh_off + sizeof(abi::QueueShadow), 4096);
  HCOMM_TRY(driver::DmaBuffer::allocate(total, -1, &_mem));  // zeroed: CQ phase 0, shadow 0
  HCOMM_TRY(_dev.map_buffer(_mem, access::RW, &_map));
  auto* base = static_cast<uint8_t*>(_mem.data());
  _sq = abi::Ring<abi::SqEntry>(reinterpret_cast<abi::SqEntry*>(base), log2);
  _cq = abi::Ring<abi::CqEntry>(reinterpret_cast<abi::CqEntry*>(base + cq_off), log2);
  _shadow = reinterpret_cast<abi::QueueShadow*>(base + sh_off);

  driver::Link& link = _dev.link();
  uint32_t vector = abi::kNoVector;
  if (interrupts) {
    if (_id >= link.msix_count() || (_dev.info().caps & abi::cap::MSIX) == 0)
      return Status::error(Code::unsupported, "queue %u: no MSI-X vector", _id);
    int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) return Status::from_errno(errno, "eventfd");
    _irq.reset(fd);
    int fds[1] = {fd};
    HCOMM_TRY(link.set_msix(_id, fds));
    vector = _id;
  }
  HCOMM_TRY(link.doorbell(reg::doorbell(_id), &_doorbell));
  // §7: program the queue while disabled, then enable and check Q_STATUS.
  HCOMM_TRY(link.write32(reg::queue(_id, reg::Q_CTRL), 0));
  HCOMM_TRY(link.write64(reg::queue(_id, reg::Q_SQ_BASE), _map.iova));
  HCOMM_TRY(link.write64(reg::queue(_id, reg::Q_CQ_BASE), _map.iova + cq_off));
  HCOMM_TRY(link.write64(reg::queue(_id, reg::Q_SHADOW), _map.iova + sh_off));
  HCOMM_TRY(link.write32(reg::queue(_id, reg::Q_SIZE_LOG2), log2));
  HCOMM_TRY(link.write32(reg::queue(_id, reg::Q_MSIX), vector));
  HCOMM_TRY(link.write32(reg::queue(_id, reg::Q_CTRL), abi::qctrl::ENABLE));
  uint32_t st = 0;
  HCOMM_TRY(link.read32(reg::queue(_id, reg::Q_STATUS), &st));
  if ((st & abi::qstatus::ENABLED) == 0)
    return Status::error(Code::device_error, "queue %u refused to enable: Q_STATUS %#x (error %u)", _id, st,
                         (st >> abi::qstatus::ERROR_SHIFT) & 0xff);
  _enabled = true;
  return Status::ok();
}

void DmaQueue::shutdown() {
  driver::Link& link = _dev.link();
  if (_enabled) {
    (void)link.write32(reg::queue(_id, reg::Q_CTRL), 0);
    _enabled = false;
  }
  if (_irq.valid()) {
    int none[1] = {-1};
    (void)link.set_msix(_id, none);
    _irq.reset();
  }
  if (_map.valid()) (void)_dev.unmap(&_map);
}

DmaQueue::~DmaQueue() {
  shutdown();
  _dev.release_queue(_id);
}

Code DmaQueue::enqueue(const abi::SqEntry& e, uint32_t* index) {
  if (in_flight() >= size()) return Code::no_resource;
  // In place: the descriptor is written straight into the ring slot. The
  // device may not read it before the tail store in submit() (release).
  _sq.at(_tail) = e;
  if (index != nullptr) *index = _tail;
  ++_tail;
  return Code::ok;
}

namespace {
abi::SqEntry make(abi::Opcode op, uint8_t flags, uint64_t user_data) {
  abi::SqEntry e{};
  e.opcode = static_cast<uint8_t>(op);
  e.flags = flags;
  e.user_data = user_data;
  return e;
}
}  // namespace

Code DmaQueue::copy(uint64_t src, uint64_t dst, uint64_t len, uint64_t user_data, uint8_t flags, uint32_t* index) {
  abi::SqEntry e = make(abi::Opcode::COPY, flags, user_data);
  e.src = src;
  e.dst = dst;
  e.length = len;
  return enqueue(e, index);
}

Code DmaQueue::fill(uint64_t dst, uint64_t len, uint64_t pattern, uint64_t user_data, uint8_t flags,
                    uint32_t* index) {
  abi::SqEntry e = make(abi::Opcode::FILL, flags, user_data);
  e.dst = dst;
  e.length = len;
  e.value = pattern;
  return enqueue(e, index);
}

Code DmaQueue::reduce(uint64_t src, uint64_t dst, uint64_t len, abi::DType dtype, abi::RedOp op,
                      uint64_t user_data, uint8_t flags, uint32_t* index) {
  abi::SqEntry e = make(abi::Opcode::REDUCE, flags, user_data);
  e.src = src;
  e.dst = dst;
  e.length = len;
  e.dtype = static_cast<uint8_t>(dtype);
  e.redop = static_cast<uint8_t>(op);
  return enqueue(e, index);
}

Code DmaQueue::notify(uint64_t dst, uint64_t value, uint64_t user_data, uint8_t flags, uint32_t* index) {
  abi::SqEntry e = make(abi::Opcode::NOTIFY, flags, user_data);
  e.dst = dst;
  e.length = 8;
  e.value = value;
  return enqueue(e, index);
}

Code DmaQueue::fetch_add(uint64_t dst, uint64_t result, uint64_t add, uint64_t user_data, uint8_t flags,
                         uint32_t* index) {
  abi::SqEntry e = make(abi::Opcode::FETCH_ADD, flags, user_data);
  e.dst = dst;
  e.src = result;
  e.length = 8;
  e.value = add;
  return enqueue(e, index);
}

Code DmaQueue::cmp_swap(uint64_t dst, uint64_t result, uint64_t compare, uint64_t swap, uint64_t user_data,
                        uint8_t flags, uint32_t* index) {
  abi::SqEntry e = make(abi::Opcode::CMP_SWAP, flags, user_data);
  e.dst = dst;
  e.src = result;
  e.length = 8;
  e.value = swap;
  e.compare = compare;
  return enqueue(e, index);
}

Code DmaQueue::nop(uint64_t user_data, uint8_t flags, uint32_t* index) {
  return enqueue(make(abi::Opcode::NOP, flags, user_data), index);
}

void DmaQueue::submit() {
  if (_tail == _published) return;
  // seq_cst store, then seq_cst load of need_wakeup: pairs with the engine's
  // "need_wakeup = 1 (seq_cst); re-read sq_tail (seq_cst)" (§8). In the single
  // total order of seq_cst operations one of the two sides sees the other's
  // store, so either the engine sees our tail or we see its flag and ring.
  _shadow->sq_tail.value.store(_tail, std::memory_order_seq_cst);
  _published = _tail;
  if (_shadow->need_wakeup.value.load(std::memory_order_seq_cst) != 0) {
    _doorbell.ring(_tail);
    ++_doorbells;
  }
}

uint32_t DmaQueue::poll(std::span<Completion> out) {
  uint32_t n = 0;
  while (n < out.size()) {
    abi::CqEntry& c = _cq.at(_cq_head);
    uint16_t info = std::atomic_ref<uint16_t>(c.info).load(std::memory_order_acquire);
    if ((info & abi::kCqPhase) != _cq.phase(_cq_head)) break;
    out[n].user_data = c.user_data;
    out[n].index = c.sq_index;
    out[n].status = static_cast<abi::CqStatus>(c.status);
    ++n;
    ++_cq_head;
  }
  if (n > 0) {
    _reaped += n;
    _shadow->cq_head.value.store(_cq_head, std::memory_order_release);
  }
  return n;
}

uint64_t DmaQueue::interrupts() {
  uint64_t cnt = 0;
  if (_irq.valid() && ::read(_irq.get(), &cnt, sizeof cnt) == sizeof cnt) _interrupts += cnt;
  return _interrupts;
}

Code DmaQueue::wait(const Deadline& deadline) {
  auto ready = [&] {
    const abi::CqEntry& c = _cq.at(_cq_head);
    uint16_t info = std::atomic_ref<uint16_t>(const_cast<uint16_t&>(c.info)).load(std::memory_order_acquire);
    return (info & abi::kCqPhase) == _cq.phase(_cq_head);
  };
  // Spin first: a sim engine or silicon completes small copies in microseconds.
  for (int i = 0; i < 2000; ++i) {
    if (ready()) return Code::ok;
    cpu_relax();
  }
  while (!ready()) {
    if (deadline.expired()) return Code::timeout;
    if (_irq.valid()) {
      pollfd p{_irq.get(), POLLIN, 0};
      int ms = std::min(deadline.remaining_ms(), 10);
      if (::poll(&p, 1, ms) > 0) {
        uint64_t cnt = 0;
        if (::read(_irq.get(), &cnt, sizeof cnt) == sizeof cnt) _interrupts += cnt;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return Code::ok;
}

Status DmaQueue::drain(const Deadline& deadline, abi::CqStatus* first_error) {
  submit();
  if (first_error != nullptr) *first_error = abi::CqStatus::OK;
  Completion c[32];
  while (in_flight() > 0) {
    if (wait(deadline) != Code::ok)
      return Status::error(Code::timeout, "queue %u: %u descriptors still in flight at the deadline", _id,
                           in_flight());
    uint32_t n = poll(c);
    for (uint32_t i = 0; i < n; ++i) {
      if (c[i].status != abi::CqStatus::OK && first_error != nullptr && *first_error == abi::CqStatus::OK)
        *first_error = c[i].status;
    }
  }
  return Status::ok();
}

}  // namespace hcomm::hal::npu
