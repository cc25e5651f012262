#include "sim/vfio_user_server.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/unix_socket.h"

namespace hcomm::sim {

namespace vu = hal::abi::vfio_user;
namespace abi = hal::abi;
using unix_socket::Io;

struct VfioUserServer::Message {
  vu::Header hdr{};
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;  // owned from arrival; closed unless handed to the device

  template <typename T>
  T as() const {  // caller checked payload.size() >= sizeof(T)
    T v;
    std::memcpy(&v, payload.data(), sizeof v);
    return v;
  }
};

struct VfioUserServer::Reply {
  uint32_t error_no = 0;  // != 0: error reply, header only
  std::vector<uint8_t> payload;
  std::vector<int> fds;  // borrowed (device-owned); the kernel dups them into the client

  void fail(int err) {
    error_no = static_cast<uint32_t>(err);
    payload.clear();
    fds.clear();
  }
  template <typename T>
  void append(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    payload.insert(payload.end(), p, p + sizeof v);
  }
};

namespace {

// How a device Status reads as an errno in a reply.
int errno_of(const Status& st) {
  switch (st.code()) {
    case Code::ok: return 0;
    case Code::invalid_argument: return EINVAL;
    case Code::not_found: return ENOENT;
    case Code::out_of_range: return ERANGE;
    case Code::access_denied: return EACCES;
    case Code::no_resource: return ENOMEM;
    case Code::unsupported: return ENOTSUP;
    case Code::timeout: return ETIMEDOUT;
    case Code::in_progress: return EBUSY;
    default: return EIO;
  }
}

void log_drop(const std::string& path, const char* why) {
  std::fprintf(stderr, "hcomm-sim: vfio-user %s: dropping client: %s\n", path.c_str(), why);
}

}  // namespace

VfioUserServer::VfioUserServer(Device& dev, std::string socket_path, VfioUserServerOptions opts)
    : SocketFront("vfio-user", std::move(socket_path)), _dev(dev), _opts(opts) {}

VfioUserServer::~VfioUserServer() { stop(); }

std::string VfioUserServer::describe() const { return "vfio-user " + _path; }

Status VfioUserServer::start() { return start_serving(); }

void VfioUserServer::stop() { stop_serving(); }

bool VfioUserServer::serve(UniqueFd client) {
  _negotiated = false;
  _peer = vu::Caps{};
  const int fd = client.get();
  const int abort_fd = stop_fd();
  bool stopped = false;
  bool dropped = false;

  for (;;) {
    // Idle between messages: no deadline, only stop() or the client.
    pollfd p[2] = {{fd, POLLIN, 0}, {abort_fd, POLLIN, 0}};
    int n = ::poll(p, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      dropped = true;
      log_drop(_path, "poll failed");
      break;
    }
    if (p[1].revents & POLLIN) {
      stopped = true;
      break;
    }
    if (p[0].revents == 0) continue;

    // From the first byte on, the whole message must arrive within the budget.
    Deadline dl = Deadline::after_ms(_opts.io_timeout_ms);
    Message m;
    bool ctrunc = false;
    size_t got = 0;
    int err = 0;
    Io io = unix_socket::recv_exact(fd, &m.hdr, sizeof m.hdr, dl, abort_fd, vu::kMaxMsgFds, &m.fds,
                                    &ctrunc, &got, &err);
    if (io == Io::aborted) { stopped = true; break; }
    if (io == Io::eof && got == 0) break;  // orderly goodbye between messages
    if (io != Io::ok) {
      dropped = true;
      log_drop(_path, io == Io::eof ? "truncated header" : unix_socket::io_name(io));
      break;
    }
    // A bad header leaves no way to find the next message: drop the client.
    const vu::Header& h = m.hdr;
    if (h.msg_size < sizeof(vu::Header) || h.msg_size > vu::kMaxMsgSize) {
      dropped = true;
      log_drop(_path, "message size out of range");
      break;
    }
    if ((h.flags & vu::msg_flag::TYPE_MASK) != vu::msg_flag::TYPE_COMMAND ||
        (h.flags & ~(vu::msg_flag::TYPE_MASK | vu::msg_flag::NO_REPLY)) != 0) {
      dropped = true;
      log_drop(_path, "not a command message (bad flags)");
      break;
    }
    m.payload.resize(h.msg_size - sizeof(vu::Header));
    io = unix_socket::recv_exact(fd, m.payload.data(), m.payload.size(), dl, abort_fd, vu::kMaxMsgFds,
                                 &m.fds, &ctrunc, &got, &err);
    if (io == Io::aborted) { stopped = true; break; }
    if (io != Io::ok) {
      dropped = true;
      log_drop(_path, io == Io::eof ? "truncated message" : unix_socket::io_name(io));
      break;
    }

    Reply r;
    if (ctrunc || m.fds.size() > vu::kMaxMsgFds) {
      r.fail(EINVAL);  // more fds than we advertised; all of them are closed below
    } else {
      dispatch(m, &r);
    }
    m.fds.clear();  // whatever the handler did not hand to the device

    if (h.flags & vu::msg_flag::NO_REPLY) continue;
    vu::Header rh{};
    rh.msg_id = h.msg_id;
    rh.command = h.command;
    rh.msg_size = static_cast<uint32_t>(sizeof rh + r.payload.size());
    rh.flags = vu::msg_flag::TYPE_REPLY | (r.error_no != 0 ? vu::msg_flag::ERROR : 0);
    rh.error_no = r.error_no;
    // The reply must drain within the same budget: a client that never reads
    // cannot wedge the server.
    Deadline sdl = Deadline::after_ms(_opts.io_timeout_ms);
    io = unix_socket::send_all(fd, {reinterpret_cast<const uint8_t*>(&rh), sizeof rh}, r.payload, r.fds,
                               sdl, abort_fd, &err);
    if (io == Io::aborted) { stopped = true; break; }
    if (io != Io::ok) {
      dropped = io != Io::eof;
      if (dropped) log_drop(_path, "reply not accepted");
      break;
    }
  }

  // The client is gone (or we are stopping): its DMA maps and irq fds go, the
  // device resets. Then the connection fd closes.
  _dev.client_gone();
  client.reset();
  if (dropped) _clients_dropped.fetch_add(1, std::memory_order_acq_rel);
  _clients_served.fetch_add(1, std::memory_order_acq_rel);
  return stopped;
}

void VfioUserServer::dispatch(Message& m, Reply* r) {
  const auto cmd = static_cast<vu::Command>(m.hdr.command);
  // Only DMA_MAP and SET_IRQS carry fds; anywhere else they are refused (and
  // closed by the caller) before the command runs.
  if (!m.fds.empty() && cmd != vu::Command::DMA_MAP && cmd != vu::Command::DEVICE_SET_IRQS) {
    return r->fail(EINVAL);
  }
  if (!_negotiated && cmd != vu::Command::VERSION) {
    return r->fail(EINVAL);  // the spec requires VERSION first
  }
  switch (cmd) {
    case vu::Command::VERSION: return do_version(m, r);
    case vu::Command::DMA_MAP: return do_dma_map(m, r);
    case vu::Command::DMA_UNMAP: return do_dma_unmap(m, r);
    case vu::Command::DEVICE_GET_INFO: return do_get_info(m, r);
    case vu::Command::DEVICE_GET_REGION_INFO: return do_region_info(m, r);
    case vu::Command::DEVICE_GET_REGION_IO_FDS: return do_region_io_fds(m, r);
    case vu::Command::DEVICE_GET_IRQ_INFO: return do_irq_info(m, r);
    case vu::Command::DEVICE_SET_IRQS: return do_set_irqs(m, r);
    case vu::Command::REGION_READ: return do_region_rw(m, r, false);
    case vu::Command::REGION_WRITE: return do_region_rw(m, r, true);
    case vu::Command::DEVICE_RESET: return do_reset(m, r);
  }
  r->fail(ENOSYS);  // DMA_READ/WRITE are server->client; DIRTY_PAGES, migration: not offered
}

void VfioUserServer::do_version(Message& m, Reply* r) {
  if (_negotiated) return r->fail(EINVAL);
  if (m.payload.size() < sizeof(vu::Version)) return r->fail(EINVAL);
  auto v = m.as<vu::Version>();
  if (v.major != vu::kVersionMajor) return r->fail(ENOTSUP);
  vu::Caps peer;
  if (m.payload.size() > sizeof(vu::Version)) {
    // Optional JSON, NUL-terminated, the NUL being the last byte.
    std::string_view json(reinterpret_cast<const char*>(m.payload.data()) + sizeof(vu::Version),
                          m.payload.size() - sizeof(vu::Version));
    if (json.back() != '\0' || json.find('\0') != json.size() - 1) return r->fail(EINVAL);
    json.remove_suffix(1);
    if (!vu::CapsParser::parse(json, &peer)) return r->fail(EINVAL);
  }
  _peer = peer;
  _negotiated = true;
  vu::Version out{vu::kVersionMajor, std::min(v.minor, vu::kVersionMinor)};
  r->append(out);
  std::string caps = vu::caps_json({vu::kMaxMsgFds, vu::kMaxDataXferSize});
  r->payload.insert(r->payload.end(), caps.begin(), caps.end());
  r->payload.push_back(0);
}

uint64_t VfioUserServer::region_size(uint32_t index) const {
  switch (index) {
    case vu::kRegionConfig: return vu::kConfigSize;
    case vu::kRegionBar0: return abi::kBar0Size;
    case vu::kRegionBar2: return _dev.hbm_size();
    default: return 0;
  }
}

void VfioUserServer::do_get_info(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::DeviceInfo)) return r->fail(EINVAL);
  auto in = m.as<vu::DeviceInfo>();
  if (in.argsz < sizeof(vu::DeviceInfo)) return r->fail(EINVAL);
  vu::DeviceInfo out{sizeof(vu::DeviceInfo), VFIO_DEVICE_FLAGS_RESET | VFIO_DEVICE_FLAGS_PCI,
                     vu::kNumRegions, vu::kNumIrqs};
  r->append(out);
}

void VfioUserServer::do_region_info(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::RegionInfo)) return r->fail(EINVAL);
  auto in = m.as<vu::RegionInfo>();
  if (in.argsz < sizeof(vu::RegionInfo) || in.index >= vu::kNumRegions) return r->fail(EINVAL);
  vu::RegionInfo out{};
  out.argsz = sizeof out;
  out.index = in.index;
  out.size = region_size(in.index);
  if (out.size != 0) out.flags = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
  // HBM is mmapable when the client can take the fd (max_msg_fds may be 0).
  if (in.index == vu::kRegionBar2 && _dev.hbm_fd() >= 0 && _peer.max_msg_fds >= 1) {
    out.flags |= VFIO_REGION_INFO_FLAG_MMAP;
    out.offset = _dev.hbm_fd_offset();
    r->fds.push_back(_dev.hbm_fd());
  }
  r->append(out);
}

void VfioUserServer::do_region_io_fds(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::RegionIoFds)) return r->fail(EINVAL);
  auto in = m.as<vu::RegionIoFds>();
  if (in.argsz < sizeof(vu::RegionIoFds) || in.flags != 0 || in.count != 0 || in.index >= vu::kNumRegions) {
    return r->fail(EINVAL);
  }
  vu::RegionIoFds out{sizeof out, 0, in.index, 0};
  std::vector<vu::IoFdSubRegion> subs;
  if (in.index == vu::kRegionBar0) {
    // One ioeventfd per queue doorbell, each its own fd so the device knows
    // the queue. Bounded by what the client can receive in one message.
    uint32_t nq = std::min<uint32_t>(_dev.config().num_queues, abi::reg::MAX_QUEUES);
    for (uint32_t q = 0; q < nq && r->fds.size() < _peer.max_msg_fds; ++q) {
      int efd = _dev.doorbell_eventfd(q);
      if (efd < 0) continue;
      vu::IoFdSubRegion s{};
      s.offset = abi::reg::doorbell(q);
      s.size = 4;
      s.fd_index = static_cast<uint32_t>(r->fds.size());
      s.type = vu::kIoFdTypeIoeventfd;
      subs.push_back(s);
      r->fds.push_back(efd);
    }
  }
  out.count = static_cast<uint32_t>(subs.size());
  out.argsz = static_cast<uint32_t>(sizeof out + subs.size() * sizeof(vu::IoFdSubRegion));
  if (in.argsz < out.argsz) {
    // Too small: say how much is needed, send nothing else.
    r->fds.clear();
    r->append(out);
    return;
  }
  r->append(out);
  for (const auto& s : subs) r->append(s);
}

void VfioUserServer::do_irq_info(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::IrqInfo)) return r->fail(EINVAL);
  auto in = m.as<vu::IrqInfo>();
  if (in.argsz < sizeof(vu::IrqInfo) || in.index >= vu::kNumIrqs) return r->fail(EINVAL);
  vu::IrqInfo out{sizeof out, 0, in.index, 0};
  if (in.index == vu::kIrqMsix) {
    out.flags = VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE;
    out.count = _dev.msix_count();
  }
  r->append(out);
}

void VfioUserServer::do_set_irqs(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::IrqSet)) return r->fail(EINVAL);  // no DATA_BOOL payloads
  auto in = m.as<vu::IrqSet>();
  if (in.argsz != m.payload.size() || in.index != vu::kIrqMsix) return r->fail(EINVAL);
  const uint32_t data = in.flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
  const uint32_t action = in.flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
  if ((in.flags & ~(VFIO_IRQ_SET_DATA_TYPE_MASK | VFIO_IRQ_SET_ACTION_TYPE_MASK)) != 0 ||
      std::popcount(data) != 1 || std::popcount(action) != 1) {
    return r->fail(EINVAL);
  }
  if (action != VFIO_IRQ_SET_ACTION_TRIGGER) return r->fail(EINVAL);  // not maskable
  const uint32_t nvec = _dev.msix_count();
  if (data == VFIO_IRQ_SET_DATA_NONE) {
    if (!m.fds.empty()) return r->fail(EINVAL);
    // start = count = 0: detach every vector. A client-side trigger of a
    // vector (count > 0) is not offered.
    if (in.start != 0 || in.count != 0) return r->fail(ENOTSUP);
    Status first;
    for (uint32_t v = 0; v < nvec; ++v) {
      Status st = _dev.set_msix(v, -1);
      if (!st && first) first = st;
    }
    if (!first) r->fail(errno_of(first));
    return;
  }
  if (data != VFIO_IRQ_SET_DATA_EVENTFD) return r->fail(ENOTSUP);
  if (in.count == 0 || in.start >= nvec || in.count > nvec - in.start) return r->fail(EINVAL);
  // `count` fds attach; none detaches the range; anything else is malformed.
  if (!m.fds.empty() && m.fds.size() != in.count) return r->fail(EINVAL);
  Status first;
  for (uint32_t i = 0; i < in.count; ++i) {
    int fd = m.fds.empty() ? -1 : m.fds[i].release();  // the device owns it from here
    Status st = _dev.set_msix(in.start + i, fd);
    if (!st && first) first = st;
  }
  if (!first) r->fail(errno_of(first));
}

void VfioUserServer::do_dma_map(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::DmaMap)) return r->fail(EINVAL);
  auto in = m.as<vu::DmaMap>();
  if (in.argsz != sizeof(vu::DmaMap)) return r->fail(EINVAL);
  if ((in.flags & ~vu::dma_flag::kKnown) != 0 || (in.flags & vu::dma_flag::kKnown) == 0) {
    return r->fail(EINVAL);
  }
  // We only support fd-backed maps (no DMA_READ/WRITE fallback).
  if (m.fds.size() != 1) return r->fail(EINVAL);
  if (in.size == 0 || in.addr + in.size < in.addr || in.offset + in.size < in.offset) {
    return r->fail(EINVAL);
  }
  // vfio-user READ/WRITE have the values of driver::dma_prot READ/WRITE
  // (sim/ cannot include driver/); translate explicitly all the same.
  uint32_t prot = ((in.flags & vu::dma_flag::READ) ? 1u : 0u) | ((in.flags & vu::dma_flag::WRITE) ? 2u : 0u);
  Status st = _dev.dma_map(in.addr, in.size, m.fds[0].release(), in.offset, prot);
  if (!st) r->fail(errno_of(st));
}

void VfioUserServer::do_dma_unmap(Message& m, Reply* r) {
  if (m.payload.size() != sizeof(vu::DmaUnmap)) return r->fail(EINVAL);
  auto in = m.as<vu::DmaUnmap>();
  if (in.argsz < sizeof(vu::DmaUnmap)) return r->fail(EINVAL);
  if (in.flags != 0) return r->fail(ENOTSUP);  // no dirty bitmaps
  if (in.size == 0 || in.addr + in.size < in.addr) return r->fail(EINVAL);
  Status st = _dev.dma_unmap(in.addr, in.size);
  if (!st) return r->fail(errno_of(st));
  vu::DmaUnmap out = in;
  out.argsz = sizeof out;
  r->append(out);
}

void VfioUserServer::do_region_rw(Message& m, Reply* r, bool write) {
  if (m.payload.size() < sizeof(vu::RegionAccess)) return r->fail(EINVAL);
  auto in = m.as<vu::RegionAccess>();
  const size_t data_len = m.payload.size() - sizeof(vu::RegionAccess);
  if (write ? data_len != in.count : data_len != 0) return r->fail(EINVAL);
  if (in.count == 0 || in.count > vu::kMaxDataXferSize) return r->fail(EINVAL);
  // A read reply must fit what the client accepts.
  if (!write && in.count > _peer.max_data_xfer_size) return r->fail(EINVAL);
  if (in.region >= vu::kNumRegions) return r->fail(EINVAL);
  const uint64_t size = region_size(in.region);
  if (in.offset > size || in.count > size - in.offset) return r->fail(EINVAL);

  std::vector<uint8_t> buf;
  uint8_t* data;
  if (write) {
    data = m.payload.data() + sizeof(vu::RegionAccess);
  } else {
    buf.resize(in.count);
    data = buf.data();
  }
  Status st;
  switch (in.region) {
    case vu::kRegionConfig:
      st = write ? _dev.config_write(in.offset, data, in.count) : _dev.config_read(in.offset, data, in.count);
      break;
    case vu::kRegionBar0:
      st = write ? _dev.bar0_write(in.offset, data, in.count) : _dev.bar0_read(in.offset, data, in.count);
      break;
    case vu::kRegionBar2:
      st = _dev.hbm_access(in.offset, data, in.count, write);
      break;
    default:
      return r->fail(EINVAL);  // unreachable: size 0 regions were refused above
  }
  if (!st) return r->fail(errno_of(st));
  r->append(in);
  if (!write) r->payload.insert(r->payload.end(), buf.begin(), buf.end());
}

void VfioUserServer::do_reset(Message& m, Reply* r) {
  if (!m.payload.empty()) return r->fail(EINVAL);
  _dev.reset();
}

}  // namespace hcomm::sim
