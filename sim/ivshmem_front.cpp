#include "sim/ivshmem_front.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/time.h"
#include "common/unix_socket.h"

namespace hcomm::sim {

namespace iv = hal::abi::ivshmem;
using unix_socket::Io;

namespace {
// Guest RAM below this is identity-mapped to the backing file (q35 puts all
// RAM below 4 GiB while the guest has less than 2.75 GiB).
constexpr uint64_t kMaxGuestRam = uint64_t{2} << 30;
}  // namespace

void ivshmem_device_config(DeviceConfig* cfg) {
  cfg->hbm_file_offset = iv::kHbmOffset;
  cfg->hbm_file_size = iv::shared_size_for(cfg->hbm_size);
}

IvshmemFront::IvshmemFront(Device& dev, std::string socket_path, IvshmemFrontOptions opts)
    : SocketFront("ivshmem", std::move(socket_path)), _dev(dev), _opts(std::move(opts)) {}

IvshmemFront::~IvshmemFront() { stop(); }

std::string IvshmemFront::describe() const {
  return "ivshmem " + _path + " (" + std::to_string(vectors()) + " vectors, " +
         std::to_string(_dev.file_size() >> 20) + " MiB shared)";
}

Status IvshmemFront::start() {
  if (serving()) return Status::error(Code::invalid_argument, "%s: already started", _path.c_str());
  const uint64_t size = _dev.file_size();
  if (_dev.hbm_fd_offset() != iv::kHbmOffset || size != iv::shared_size_for(_dev.hbm_size()))
    return Status::error(Code::invalid_argument,
                         "ivshmem front: device memory is not laid out for ivshmem (see ivshmem_device_config)");
  // Header first, then an idle mailbox: both are in the memfd before any
  // guest can map it.
  iv::Header h{};
  h.magic = iv::kMagic;
  h.version = iv::kLayoutVersion;
  h.sim_peer = iv::kSimPeer;
  h.shared_size = size;
  h.hbm_offset = iv::kHbmOffset;
  h.hbm_size = _dev.hbm_size();
  h.num_queues = _dev.config().num_queues;
  h.vectors = vectors();
  h.mailbox_vector = iv::kMailboxVector;
  h.doorbell_vector_base = iv::kDoorbellVectorBase;
  std::memcpy(_dev.file_base() + iv::kHeaderOffset, &h, sizeof h);
  _mb = reinterpret_cast<iv::Mailbox*>(_dev.file_base() + iv::kMailboxOffset);
  std::memset(static_cast<void*>(_mb), 0, sizeof *_mb);
  _live = reinterpret_cast<iv::Liveness*>(_dev.file_base() + iv::kLivenessOffset);
  std::memset(static_cast<void*>(_live), 0, sizeof *_live);
  __atomic_store_n(&_live->resets, _dev.self_resets(), __ATOMIC_RELEASE);
  iv::Liveness* live = _live;
  _dev.set_self_reset_hook([live](uint64_t n) { __atomic_store_n(&live->resets, n, __ATOMIC_RELEASE); });

  UniqueFd mb_efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!mb_efd.valid()) return Status::from_errno(errno, "eventfd");
  _mailbox_efd = std::move(mb_efd);
  Status st = start_serving();
  if (!st) _mailbox_efd.reset();
  return st;
}

void IvshmemFront::stop() {
  stop_serving();
  _mailbox_efd.reset();
}

bool IvshmemFront::serve(UniqueFd client) {
  const int fd = client.get();
  const int abort_fd = stop_fd();
  const uint32_t nvec = vectors();
  Deadline dl = Deadline::after_ms(_opts.io_timeout_ms);
  int err = 0;
  auto send = [&](int64_t v, int with_fd) {
    uint8_t b[8];
    std::memcpy(b, &v, 8);  // little-endian host
    int fds[1] = {with_fd};
    return unix_socket::send_all(fd, {b, 8}, {}, std::span<const int>(fds, with_fd >= 0 ? 1 : 0), dl, abort_fd,
                                 &err);
  };
  // A new guest starts from an idle mailbox: whatever a previous one left
  // half-written is not executed.
  _last_seq = __atomic_load_n(&_mb->seq, __ATOMIC_ACQUIRE);
  __atomic_store_n(&_mb->ack, _last_seq, __ATOMIC_RELEASE);

  _guest_irq.clear();
  for (uint32_t v = 0; v < nvec; ++v) {
    UniqueFd e(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!e.valid()) {
      std::fprintf(stderr, "hcomm-sim: ivshmem %s: eventfd: %s\n", _path.c_str(), std::strerror(errno));
      return false;
    }
    _guest_irq.push_back(std::move(e));
  }
  // Set-up, in the order the spec gives: version, the guest's id, the
  // shared memory, the other peer's (our) vectors, the guest's own vectors.
  Io io = send(iv::kProtocolVersion, -1);
  if (io == Io::ok) io = send(iv::kGuestPeer, -1);
  if (io == Io::ok) io = send(iv::kShmMessage, _dev.hbm_fd());
  for (uint32_t v = 0; v < nvec && io == Io::ok; ++v) {
    int efd = v == iv::kMailboxVector ? _mailbox_efd.get() : _dev.doorbell_eventfd(v - iv::kDoorbellVectorBase);
    io = send(iv::kSimPeer, efd);
  }
  for (uint32_t v = 0; v < nvec && io == Io::ok; ++v) io = send(iv::kGuestPeer, _guest_irq[v].get());
  if (io != Io::ok) {
    if (io != Io::aborted)
      std::fprintf(stderr, "hcomm-sim: ivshmem %s: set-up messages: %s\n", _path.c_str(), unix_socket::io_name(io));
    _guest_irq.clear();
    return io == Io::aborted;
  }
  // MSI-X vector v of the device interrupts the guest on ivshmem vector v.
  for (uint32_t v = 0; v < _dev.msix_count() && v < nvec; ++v) (void)_dev.set_msix(v, ::dup(_guest_irq[v].get()));
  std::fprintf(stderr, "hcomm-sim: ivshmem %s: guest connected\n", _path.c_str());

  bool stopped = false;
  for (;;) {
    pollfd p[3] = {{fd, POLLIN, 0}, {_mailbox_efd.get(), POLLIN, 0}, {abort_fd, POLLIN, 0}};
    // The timeout covers a kick lost between seq and the doorbell, and paces
    // the heartbeat the guest's driver watches (iv::Liveness).
    __atomic_fetch_add(&_live->heartbeat, 1, __ATOMIC_RELEASE);
    int n = ::poll(p, 3, static_cast<int>(iv::kHeartbeatMs));
    if (n < 0 && errno != EINTR) break;
    if (p[2].revents & POLLIN) {
      stopped = true;
      break;
    }
    if (p[1].revents & POLLIN) {
      uint64_t cnt;
      ssize_t r = ::read(_mailbox_efd.get(), &cnt, sizeof cnt);
      (void)r;
    }
    handle_mailbox();
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      // QEMU sends nothing after connecting: data is ignored, EOF means the
      // guest is gone.
      uint8_t junk[256];
      ssize_t r = ::recv(fd, junk, sizeof junk, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) break;
    }
  }
  std::fprintf(stderr, "hcomm-sim: ivshmem %s: guest %s\n", _path.c_str(), stopped ? "dropped (stop)" : "gone");
  _dev.client_gone();
  _guest_irq.clear();
  _ram.reset();
  _ram_size = 0;
  _clients_served.fetch_add(1, std::memory_order_acq_rel);
  return stopped;
}

void IvshmemFront::handle_mailbox() {
  const uint32_t seq = __atomic_load_n(&_mb->seq, __ATOMIC_ACQUIRE);
  if (seq == _last_seq) return;
  // Copy the request out once: the guest may scribble on it meanwhile.
  const uint32_t op = __atomic_load_n(&_mb->op, __ATOMIC_RELAXED);
  const uint32_t width = __atomic_load_n(&_mb->width, __ATOMIC_RELAXED);
  const uint64_t offset = __atomic_load_n(&_mb->offset, __ATOMIC_RELAXED);
  uint64_t value = __atomic_load_n(&_mb->value, __ATOMIC_RELAXED);
  const uint64_t len = __atomic_load_n(&_mb->len, __ATOMIC_RELAXED);
  const uint32_t prot = __atomic_load_n(&_mb->prot, __ATOMIC_RELAXED);
  Status st = execute(op, width, offset, len, prot, &value);
  char msg[iv::kMailboxMessageLen] = {};
  if (!st) std::snprintf(msg, sizeof msg, "%s", st.message().c_str());
  std::memcpy(_mb->message, msg, sizeof msg);
  __atomic_store_n(&_mb->value, value, __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->status, static_cast<int32_t>(st.code()), __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->ack, seq, __ATOMIC_RELEASE);
  _last_seq = seq;
}

Status IvshmemFront::open_guest_ram() {
  if (_ram.valid()) return Status::ok();
  if (_opts.guest_ram_path.empty())
    return Status::error(Code::unsupported, "hcomm-sim was started without --guest-ram: the device cannot reach guest memory");
  UniqueFd f(::open(_opts.guest_ram_path.c_str(), O_RDWR | O_CLOEXEC));
  if (!f.valid()) return Status::from_errno(errno, "open guest RAM " + _opts.guest_ram_path);
  struct stat sb {};
  if (::fstat(f.get(), &sb) != 0) return Status::from_errno(errno, "fstat guest RAM");
  const uint64_t size = static_cast<uint64_t>(sb.st_size);
  if (size == 0 || size > kMaxGuestRam)
    return Status::error(Code::unsupported, "guest RAM file is %llu bytes: need 1 byte .. 2 GiB (identity-mapped)",
                         static_cast<unsigned long long>(size));
  _ram = std::move(f);
  _ram_size = size;
  return Status::ok();
}

void IvshmemFront::transport_reset() {
  // A new driver instance owns the function: nothing of the previous one
  // survives but the transport's interrupt wiring.
  _dev.client_gone();
  for (uint32_t v = 0; v < _dev.msix_count() && v < _guest_irq.size(); ++v)
    (void)_dev.set_msix(v, ::dup(_guest_irq[v].get()));
}

Status IvshmemFront::execute(uint32_t op, uint32_t width, uint64_t offset, uint64_t len, uint32_t prot,
                             uint64_t* value) {
  switch (static_cast<iv::MailboxOp>(op)) {
    case iv::MailboxOp::bar0_read:
      *value = 0;
      return _dev.bar0_read(offset, value, width);
    case iv::MailboxOp::bar0_write:
      return _dev.bar0_write(offset, value, width);
    case iv::MailboxOp::config_write:
      if (width != 1 && width != 2 && width != 4)
        return Status::error(Code::invalid_argument, "config write of %u bytes", width);
      return _dev.config_write(offset, value, width);
    case iv::MailboxOp::dma_map: {
      HCOMM_TRY(open_guest_ram());
      if (len == 0 || offset > _ram_size || len > _ram_size - offset)
        return Status::error(Code::out_of_range, "DMA map [%#llx,+%#llx) is outside the guest's %llu MiB of RAM",
                             static_cast<unsigned long long>(offset), static_cast<unsigned long long>(len),
                             static_cast<unsigned long long>(_ram_size >> 20));
      int fd = ::dup(_ram.get());
      if (fd < 0) return Status::from_errno(errno, "dup guest RAM fd");
      return _dev.dma_map(offset, len, fd, offset, prot);
    }
    case iv::MailboxOp::dma_unmap:
      return _dev.dma_unmap(offset, len);
    case iv::MailboxOp::reset:
      _dev.reset();
      return Status::ok();
    case iv::MailboxOp::new_driver:
      transport_reset();
      return Status::ok();
  }
  return Status::error(Code::invalid_argument, "unknown mailbox op %u", op);
}

}  // namespace hcomm::sim
