#include "driver/vfio_user_link.h"

#include <sys/mman.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/time.h"
#include "common/unix_socket.h"
#include "hal/abi/vfio_user.h"

namespace hcomm::driver {

namespace vu = hal::abi::vfio_user;
using unix_socket::Io;

static_assert(dma_prot::READ == vu::dma_flag::READ && dma_prot::WRITE == vu::dma_flag::WRITE,
              "Link DMA rights are passed through as vfio-user DMA_MAP flags");

namespace {

// Bus addresses this link hands out: page granular, above 4 GiB (so a bus
// address is never 0 and never looks like a small HBM offset), with one
// unmapped guard page between mappings so an overrun faults in the device
// instead of landing in the neighbour.
constexpr uint64_t kPage = 4096;
constexpr uint64_t kDmaBase = 1ull << 32;
constexpr uint64_t kDmaLimit = 1ull << 48;
constexpr uint64_t kDmaGuard = kPage;

// An error reply's errno as a Code.
Code code_of_errno(uint32_t e) {
  switch (e) {
    case EINVAL: case EEXIST: return Code::invalid_argument;
    case ENOENT: return Code::not_found;
    case ERANGE: case EFAULT: return Code::out_of_range;
    case EACCES: case EPERM: return Code::access_denied;
    case ENOMEM: case ENOSPC: case EBUSY: return Code::no_resource;
    case ENOSYS: case ENOTSUP: return Code::unsupported;
    case ETIMEDOUT: return Code::timeout;
    default: return Code::io_error;
  }
}

template <typename T>
std::span<const uint8_t> bytes_of(const T& v) {
  return {reinterpret_cast<const uint8_t*>(&v), sizeof v};
}

template <typename T>
T load(const std::vector<uint8_t>& buf, size_t off = 0) {  // caller checked the size
  T v;
  std::memcpy(&v, buf.data() + off, sizeof v);
  return v;
}

class VfioUserLink final : public Link {
 public:
  VfioUserLink(std::string path, UniqueFd sock, int timeout_ms)
      : _path(std::move(path)), _sock(std::move(sock)), _timeout_ms(timeout_ms) {}

  ~VfioUserLink() override {
    for (auto& r : _regions) {
      if (r.map != nullptr) ::munmap(r.map, r.info.size);
    }
    // Closing the socket tells the server the client is gone: it drops our
    // DMA maps and interrupt fds and resets the device.
  }

  Status init();

  const char* kind() const override { return "vfio-user"; }
  std::string location() const override { return _path; }

  Status region_info(uint32_t region, RegionInfo* out) override {
    if (region >= vu::kNumRegions) return Status::error(Code::not_found, "no region %u", region);
    *out = _regions[region].info;  // immutable after init()
    return Status::ok();
  }

  Status map_region(uint32_t region, void** out, uint64_t* size) override;
  Status read(uint32_t region, uint64_t offset, void* data, size_t len) override;
  Status write(uint32_t region, uint64_t offset, const void* data, size_t len) override;
  Status doorbell(uint64_t bar0_offset, Doorbell* out) override;
  Status set_msix(uint32_t first_vector, std::span<const int> eventfds) override;
  uint32_t msix_count() const override { return _msix_count; }
  Status dma_map(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                 uint64_t* bus_addr) override;
  Status dma_unmap(uint64_t bus_addr, uint64_t len) override;
  Status reset() override;
  Status health() override;

 private:
  struct Region {
    RegionInfo info;
    UniqueFd fd;          // mmapable regions: the fd from the region info reply
    uint64_t mmap_offset = 0;
    void* map = nullptr;  // map_region(): lives as long as the link
  };

  // One request/reply. Caller holds _mu. `reply` gets the payload, `reply_fds`
  // (nullptr: none expected) the fds that came with it.
  Status transact(vu::Command cmd, std::span<const uint8_t> a, std::span<const uint8_t> b,
                  std::span<const int> fds, std::vector<uint8_t>* reply, std::vector<UniqueFd>* reply_fds);
  // The stream is no longer usable: remember why and fail from now on.
  Status broken(Status st) {
    _broken = st;
    _sock.reset();
    return st;
  }
  Status check_access(uint32_t region, uint64_t offset, size_t len) const;
  Status load_io_fds();

  const std::string _path;
  std::mutex _mu;  // guards everything below that is not immutable after init()
  UniqueFd _sock;
  const int _timeout_ms;
  Status _broken;  // !ok: every call fails with this
  uint16_t _next_id = 0;

  // Immutable after init().
  vu::Caps _server;  // what the server accepts (spec defaults until VERSION)
  std::array<Region, vu::kNumRegions> _regions;
  uint32_t _msix_count = 0;
  std::vector<UniqueFd> _io_fds;        // doorbell ioeventfds
  std::map<uint64_t, int> _doorbells;   // BAR0 offset -> fd in _io_fds

  std::map<uint64_t, uint64_t> _dma;  // bus address -> mapped (page-rounded) size
};

Status VfioUserLink::transact(vu::Command cmd, std::span<const uint8_t> a, std::span<const uint8_t> b,
                              std::span<const int> fds, std::vector<uint8_t>* reply,
                              std::vector<UniqueFd>* reply_fds) {
  const char* name = vu::command_name(static_cast<uint16_t>(cmd));
  if (!_broken.is_ok()) return _broken;
  const size_t size = sizeof(vu::Header) + a.size() + b.size();
  if (size > vu::kMaxMsgSize) {
    return Status::error(Code::invalid_argument, "vfio-user %s: %zu-byte message too large", name, size);
  }
  if (fds.size() > _server.max_msg_fds) {
    return Status::error(Code::invalid_argument, "vfio-user %s: %zu fds, server takes %llu", name, fds.size(),
                         static_cast<unsigned long long>(_server.max_msg_fds));
  }
  vu::Header h{};
  h.msg_id = _next_id++;
  h.command = static_cast<uint16_t>(cmd);
  h.msg_size = static_cast<uint32_t>(size);
  h.flags = vu::msg_flag::TYPE_COMMAND;

  // Header and payload go out as one sendmsg when they can (the fds ride on
  // the header's first byte either way).
  std::vector<uint8_t> body;
  std::span<const uint8_t> second = a;
  if (!b.empty()) {
    body.reserve(a.size() + b.size());
    body.insert(body.end(), a.begin(), a.end());
    body.insert(body.end(), b.begin(), b.end());
    second = body;
  }
  Deadline dl = Deadline::after_ms(_timeout_ms);
  int err = 0;
  auto io_fail = [&](Io io, const char* what) {
    switch (io) {
      case Io::eof:
        return broken(Status::error(Code::peer_failure,
                                    "vfio-user %s %s: the device's server hung up (hcomm-sim exited or was killed) "
                                    "while %s",
                                    _path.c_str(), name, what));
      case Io::timeout:
        return broken(Status::error(Code::timeout, "vfio-user %s %s: no reply within %d ms (%s)", _path.c_str(),
                                    name, _timeout_ms, what));
      default:
        return broken(Status::error(Code::io_error, "vfio-user %s %s: %s: %s", _path.c_str(), name, what,
                                    std::strerror(err)));
    }
  };
  Io io = unix_socket::send_all(_sock.get(), bytes_of(h), second, fds, dl, -1, &err);
  if (io != Io::ok) return io_fail(io, "sending");

  vu::Header rh{};
  std::vector<UniqueFd> got_fds;
  bool ctrunc = false;
  size_t got = 0;
  io = unix_socket::recv_exact(_sock.get(), &rh, sizeof rh, dl, -1, vu::kMaxMsgFds, &got_fds, &ctrunc, &got, &err);
  if (io != Io::ok) return io_fail(io, "reading the reply header");
  if ((rh.flags & vu::msg_flag::TYPE_MASK) != vu::msg_flag::TYPE_REPLY) {
    return broken(Status::error(Code::protocol_error, "vfio-user %s %s: expected a reply, got message type %u",
                                _path.c_str(), name, rh.flags & vu::msg_flag::TYPE_MASK));
  }
  if (rh.msg_id != h.msg_id || rh.command != h.command) {
    return broken(Status::error(Code::protocol_error,
                                "vfio-user %s %s: reply is for msg_id %u command %u, expected msg_id %u command %u",
                                _path.c_str(), name, rh.msg_id, rh.command, h.msg_id, h.command));
  }
  if (rh.msg_size < sizeof rh || rh.msg_size > vu::kMaxMsgSize) {
    return broken(Status::error(Code::protocol_error, "vfio-user %s %s: reply size %u out of range", _path.c_str(),
                                name, rh.msg_size));
  }
  std::vector<uint8_t> payload(rh.msg_size - sizeof rh);
  io = unix_socket::recv_exact(_sock.get(), payload.data(), payload.size(), dl, -1, vu::kMaxMsgFds, &got_fds,
                               &ctrunc, &got, &err);
  if (io != Io::ok) return io_fail(io, "reading the reply payload");

  // The stream is in sync from here on; a bad reply fails only this call.
  if (rh.flags & vu::msg_flag::ERROR) {
    uint32_t e = rh.error_no;
    return Status::error(code_of_errno(e), "vfio-user %s %s: server replied error %u (%s)", _path.c_str(), name, e,
                         e != 0 ? std::strerror(static_cast<int>(e)) : "unspecified");
  }
  if (ctrunc || (reply_fds == nullptr && !got_fds.empty())) {
    return Status::error(Code::protocol_error, "vfio-user %s %s: reply carried %zu unexpected fds (closed)",
                         _path.c_str(), name, got_fds.size());
  }
  if (reply != nullptr) *reply = std::move(payload);
  if (reply_fds != nullptr) *reply_fds = std::move(got_fds);
  return Status::ok();
}

Status VfioUserLink::init() {
  std::lock_guard lk(_mu);
  std::vector<uint8_t> rep;
  std::vector<UniqueFd> rfds;

  // 1. VERSION: propose 0.1 and what we accept.
  {
    vu::Version v{vu::kVersionMajor, vu::kVersionMinor};
    std::string caps = vu::caps_json({vu::kMaxMsgFds, vu::kMaxDataXferSize});
    std::vector<uint8_t> data(caps.begin(), caps.end());
    data.push_back(0);
    Status st = transact(vu::Command::VERSION, bytes_of(v), data, {}, &rep, nullptr);
    if (st.code() == Code::timeout) {
      // The usual cause: the server is busy with another client.
      return Status(Code::timeout, st.message() + " (a vfio-user server serves one client at a time)");
    }
    HCOMM_TRY(st);
    if (rep.size() < sizeof(vu::Version)) {
      return Status::error(Code::protocol_error, "vfio-user %s: short VERSION reply", _path.c_str());
    }
    auto sv = load<vu::Version>(rep);
    if (sv.major != vu::kVersionMajor || sv.minor > vu::kVersionMinor) {
      return Status::error(Code::unsupported, "vfio-user %s: server answered version %u.%u to our %u.%u",
                           _path.c_str(), sv.major, sv.minor, vu::kVersionMajor, vu::kVersionMinor);
    }
    vu::Caps server;
    if (rep.size() > sizeof(vu::Version)) {
      std::string_view json(reinterpret_cast<const char*>(rep.data()) + sizeof(vu::Version),
                            rep.size() - sizeof(vu::Version));
      if (json.back() != '\0' || json.find('\0') != json.size() - 1 ||
          !vu::CapsParser::parse(json.substr(0, json.size() - 1), &server)) {
        return Status::error(Code::protocol_error, "vfio-user %s: malformed capabilities in VERSION reply",
                             _path.c_str());
      }
    }
    if (server.max_data_xfer_size == 0) {
      return Status::error(Code::protocol_error, "vfio-user %s: server max_data_xfer_size is 0", _path.c_str());
    }
    _server = server;
  }

  // 2. DEVICE_GET_INFO: must be a PCI device with the standard regions.
  {
    vu::DeviceInfo req{sizeof(vu::DeviceInfo), 0, 0, 0};
    HCOMM_TRY(transact(vu::Command::DEVICE_GET_INFO, bytes_of(req), {}, {}, &rep, nullptr));
    if (rep.size() < sizeof(vu::DeviceInfo)) {
      return Status::error(Code::protocol_error, "vfio-user %s: short DEVICE_GET_INFO reply", _path.c_str());
    }
    auto info = load<vu::DeviceInfo>(rep);
    if (!(info.flags & VFIO_DEVICE_FLAGS_PCI) || info.num_regions < vu::kNumRegions || info.num_irqs <= vu::kIrqMsix) {
      return Status::error(Code::unsupported, "vfio-user %s: not a PCI device (flags %#x, %u regions, %u irqs)",
                           _path.c_str(), info.flags, info.num_regions, info.num_irqs);
    }
  }

  // 3. DEVICE_GET_REGION_INFO for every PCI region, cached.
  for (uint32_t i = 0; i < vu::kNumRegions; ++i) {
    vu::RegionInfo req{};
    req.argsz = sizeof req;
    req.index = i;
    HCOMM_TRY(transact(vu::Command::DEVICE_GET_REGION_INFO, bytes_of(req), {}, {}, &rep, &rfds));
    if (rep.size() < sizeof(vu::RegionInfo)) {
      return Status::error(Code::protocol_error, "vfio-user %s: short region %u info", _path.c_str(), i);
    }
    auto ri = load<vu::RegionInfo>(rep);
    const bool mmap = ri.flags & VFIO_REGION_INFO_FLAG_MMAP;
    if (ri.index != i || rfds.size() != (mmap ? 1u : 0u)) {
      return Status::error(Code::protocol_error, "vfio-user %s: region %u info: index %u, %zu fds (mmap %d)",
                           _path.c_str(), i, ri.index, rfds.size(), mmap ? 1 : 0);
    }
    Region& r = _regions[i];
    r.info.index = i;
    r.info.size = ri.size;
    r.info.readable = ri.flags & VFIO_REGION_INFO_FLAG_READ;
    r.info.writable = ri.flags & VFIO_REGION_INFO_FLAG_WRITE;
    r.info.mmapable = mmap && ri.size > 0;
    r.mmap_offset = ri.offset;
    if (mmap) r.fd = std::move(rfds[0]);
    rfds.clear();
  }

  // 4. MSI-X vectors.
  {
    vu::IrqInfo req{sizeof(vu::IrqInfo), 0, vu::kIrqMsix, 0};
    HCOMM_TRY(transact(vu::Command::DEVICE_GET_IRQ_INFO, bytes_of(req), {}, {}, &rep, nullptr));
    if (rep.size() < sizeof(vu::IrqInfo)) {
      return Status::error(Code::protocol_error, "vfio-user %s: short IRQ info", _path.c_str());
    }
    auto ii = load<vu::IrqInfo>(rep);
    if (ii.index != vu::kIrqMsix) {
      return Status::error(Code::protocol_error, "vfio-user %s: IRQ info for index %u, asked %u", _path.c_str(),
                           ii.index, vu::kIrqMsix);
    }
    _msix_count = (ii.flags & VFIO_IRQ_INFO_EVENTFD) ? ii.count : 0;
  }

  // 5. Doorbell ioeventfds (optional: a server without them leaves doorbells
  //    to REGION_WRITE).
  return load_io_fds();
}

Status VfioUserLink::load_io_fds() {
  const uint64_t bar0 = _regions[vu::kRegionBar0].info.size;
  // Room for a typical doorbell page; a server with more says so and we ask again.
  uint32_t argsz = sizeof(vu::RegionIoFds) + 32 * sizeof(vu::IoFdSubRegion);
  std::vector<uint8_t> rep;
  std::vector<UniqueFd> rfds;
  for (int attempt = 0; attempt < 2; ++attempt) {
    vu::RegionIoFds req{argsz, 0, vu::kRegionBar0, 0};
    Status st = transact(vu::Command::DEVICE_GET_REGION_IO_FDS, bytes_of(req), {}, {}, &rep, &rfds);
    if (!st) {
      // An error reply (e.g. ENOSYS): no ioeventfds. A broken stream is fatal.
      return _broken.is_ok() ? Status::ok() : st;
    }
    if (rep.size() < sizeof(vu::RegionIoFds)) {
      return Status::error(Code::protocol_error, "vfio-user %s: short GET_REGION_IO_FDS reply", _path.c_str());
    }
    auto hdr = load<vu::RegionIoFds>(rep);
    if (hdr.argsz > argsz && attempt == 0 && hdr.argsz <= vu::kMaxDataXferSize) {
      argsz = hdr.argsz;  // the server has more sub-regions than we guessed
      continue;
    }
    if (hdr.index != vu::kRegionBar0 ||
        rep.size() < sizeof(vu::RegionIoFds) + uint64_t{hdr.count} * sizeof(vu::IoFdSubRegion)) {
      return Status::error(Code::protocol_error, "vfio-user %s: GET_REGION_IO_FDS reply: index %u, %u sub-regions "
                           "in %zu bytes", _path.c_str(), hdr.index, hdr.count, rep.size());
    }
    _io_fds = std::move(rfds);
    for (uint32_t i = 0; i < hdr.count; ++i) {
      auto s = load<vu::IoFdSubRegion>(rep, sizeof(vu::RegionIoFds) + i * sizeof(vu::IoFdSubRegion));
      if (s.type != vu::kIoFdTypeIoeventfd || s.fd_index >= _io_fds.size() || s.offset > bar0 ||
          s.size > bar0 - s.offset) {
        return Status::error(Code::protocol_error, "vfio-user %s: bad ioeventfd sub-region %u", _path.c_str(), i);
      }
      // Doorbell::ring writes an arbitrary value: a datamatch ioeventfd would
      // not fire for it, so such a sub-region is not a usable doorbell.
      if (s.flags != 0) continue;
      _doorbells[s.offset] = _io_fds[s.fd_index].get();
    }
    return Status::ok();
  }
  return Status::error(Code::protocol_error, "vfio-user %s: GET_REGION_IO_FDS size keeps growing", _path.c_str());
}

Status VfioUserLink::map_region(uint32_t region, void** out, uint64_t* size) {
  std::lock_guard lk(_mu);
  if (region >= vu::kNumRegions) return Status::error(Code::not_found, "no region %u", region);
  Region& r = _regions[region];
  if (!r.info.mmapable || !r.fd.valid()) {
    return Status::error(Code::unsupported, "vfio-user %s: region %u is not mmapable", _path.c_str(), region);
  }
  if (r.map == nullptr) {
    void* p = ::mmap(nullptr, r.info.size, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd.get(),
                     static_cast<off_t>(r.mmap_offset));
    if (p == MAP_FAILED) return Status::from_errno(errno, "mmap of vfio-user region " + std::to_string(region));
    r.map = p;
  }
  *out = r.map;
  *size = r.info.size;
  return Status::ok();
}

Status VfioUserLink::check_access(uint32_t region, uint64_t offset, size_t len) const {
  if (region >= vu::kNumRegions) return Status::error(Code::not_found, "no region %u", region);
  const RegionInfo& ri = _regions[region].info;
  if (len == 0 || offset > ri.size || len > ri.size - offset) {
    return Status::error(Code::out_of_range, "region %u access [%#llx,+%zu) outside %llu bytes", region,
                         static_cast<unsigned long long>(offset), len, static_cast<unsigned long long>(ri.size));
  }
  if (len > _server.max_data_xfer_size || len > vu::kMaxDataXferSize) {
    return Status::error(Code::invalid_argument, "region access of %zu bytes exceeds the transfer limit", len);
  }
  return Status::ok();
}

Status VfioUserLink::read(uint32_t region, uint64_t offset, void* data, size_t len) {
  HCOMM_TRY(check_access(region, offset, len));
  if (!_regions[region].info.readable) return Status::error(Code::access_denied, "region %u not readable", region);
  std::lock_guard lk(_mu);
  vu::RegionAccess req{offset, region, static_cast<uint32_t>(len)};
  std::vector<uint8_t> rep;
  HCOMM_TRY(transact(vu::Command::REGION_READ, bytes_of(req), {}, {}, &rep, nullptr));
  if (rep.size() != sizeof(vu::RegionAccess) + len) {
    return Status::error(Code::protocol_error, "vfio-user %s: REGION_READ reply of %zu bytes for %zu", _path.c_str(),
                         rep.size(), len);
  }
  auto echo = load<vu::RegionAccess>(rep);
  if (echo.offset != offset || echo.region != region || echo.count != len) {
    return Status::error(Code::protocol_error, "vfio-user %s: REGION_READ reply does not match the request",
                         _path.c_str());
  }
  std::memcpy(data, rep.data() + sizeof(vu::RegionAccess), len);
  return Status::ok();
}

Status VfioUserLink::write(uint32_t region, uint64_t offset, const void* data, size_t len) {
  HCOMM_TRY(check_access(region, offset, len));
  if (!_regions[region].info.writable) return Status::error(Code::access_denied, "region %u not writable", region);
  std::lock_guard lk(_mu);
  vu::RegionAccess req{offset, region, static_cast<uint32_t>(len)};
  std::vector<uint8_t> rep;
  HCOMM_TRY(transact(vu::Command::REGION_WRITE, bytes_of(req), {static_cast<const uint8_t*>(data), len}, {}, &rep,
                     nullptr));
  if (rep.size() < sizeof(vu::RegionAccess)) {
    return Status::error(Code::protocol_error, "vfio-user %s: short REGION_WRITE reply", _path.c_str());
  }
  auto echo = load<vu::RegionAccess>(rep);
  if (echo.offset != offset || echo.region != region || echo.count != len) {
    return Status::error(Code::protocol_error, "vfio-user %s: REGION_WRITE reply does not match the request",
                         _path.c_str());
  }
  return Status::ok();
}

Status VfioUserLink::doorbell(uint64_t bar0_offset, Doorbell* out) {
  auto it = _doorbells.find(bar0_offset);  // immutable after init()
  if (it == _doorbells.end()) {
    return Status::error(Code::unsupported, "vfio-user %s: no ioeventfd for BAR0 offset %#llx (ring it with write32)",
                         _path.c_str(), static_cast<unsigned long long>(bar0_offset));
  }
  *out = Doorbell{};
  out->eventfd = it->second;  // owned by the link
  return Status::ok();
}

Status VfioUserLink::set_msix(uint32_t first_vector, std::span<const int> eventfds) {
  if (eventfds.empty()) return Status::ok();
  if (first_vector >= _msix_count || eventfds.size() > _msix_count - first_vector) {
    return Status::error(Code::invalid_argument, "MSI-X vectors [%u,+%zu) outside the device's %u", first_vector,
                         eventfds.size(), _msix_count);
  }
  std::lock_guard lk(_mu);
  // Runs of real fds attach (at most max_msg_fds per message); runs of -1
  // detach (DATA_EVENTFD with no fds).
  size_t i = 0;
  while (i < eventfds.size()) {
    const bool attach = eventfds[i] >= 0;
    size_t j = i + 1;
    while (j < eventfds.size() && (eventfds[j] >= 0) == attach) ++j;
    if (attach) {
      if (_server.max_msg_fds == 0) {
        return Status::error(Code::unsupported, "vfio-user %s: server accepts no fds", _path.c_str());
      }
      j = std::min<size_t>(j, i + _server.max_msg_fds);
    }
    vu::IrqSet req{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER, vu::kIrqMsix,
                   static_cast<uint32_t>(first_vector + i), static_cast<uint32_t>(j - i)};
    std::span<const int> fds = attach ? eventfds.subspan(i, j - i) : std::span<const int>{};
    HCOMM_TRY(transact(vu::Command::DEVICE_SET_IRQS, bytes_of(req), {}, fds, nullptr, nullptr));
    i = j;
  }
  return Status::ok();
}

Status VfioUserLink::dma_map(void* /*vaddr*/, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                             uint64_t* bus_addr) {
  // The server maps `fd` itself; vaddr only names the same memory on our side.
  if (fd < 0) {
    return Status::error(Code::invalid_argument, "vfio-user DMA map needs the memory's fd (memfd / hugetlbfs)");
  }
  if (len == 0 || len > kDmaLimit - kDmaBase) return Status::error(Code::invalid_argument, "DMA map of %llu bytes",
                                                                    static_cast<unsigned long long>(len));
  if (prot == 0 || (prot & ~(dma_prot::READ | dma_prot::WRITE)) != 0) {
    return Status::error(Code::invalid_argument, "DMA map: bad rights %#x", prot);
  }
  if (fd_offset % kPage != 0) {
    return Status::error(Code::invalid_argument, "DMA map: fd offset %#llx not page aligned",
                         static_cast<unsigned long long>(fd_offset));
  }
  // The device maps whole pages (as an IOMMU would).
  const uint64_t size = (len + kPage - 1) & ~(kPage - 1);
  std::lock_guard lk(_mu);
  // First fit over the sorted allocations, keeping a guard page after each.
  uint64_t addr = kDmaBase;
  for (const auto& [start, sz] : _dma) {
    if (addr + size + kDmaGuard <= start) break;
    addr = std::max(addr, start + sz + kDmaGuard);
  }
  if (addr + size > kDmaLimit) return Status::error(Code::no_resource, "DMA bus address space exhausted");

  vu::DmaMap req{sizeof(vu::DmaMap), prot, fd_offset, addr, size};
  int fds[1] = {fd};
  HCOMM_TRY(transact(vu::Command::DMA_MAP, bytes_of(req), {}, fds, nullptr, nullptr));
  _dma[addr] = size;
  *bus_addr = addr;
  return Status::ok();
}

Status VfioUserLink::dma_unmap(uint64_t bus_addr, uint64_t len) {
  std::lock_guard lk(_mu);
  auto it = _dma.find(bus_addr);
  const uint64_t size = (len + kPage - 1) & ~(kPage - 1);
  if (it == _dma.end() || len == 0 || it->second != size) {
    return Status::error(Code::not_found, "no DMA mapping [%#llx,+%#llx)", static_cast<unsigned long long>(bus_addr),
                         static_cast<unsigned long long>(len));
  }
  vu::DmaUnmap req{sizeof(vu::DmaUnmap), 0, bus_addr, size};
  std::vector<uint8_t> rep;
  HCOMM_TRY(transact(vu::Command::DMA_UNMAP, bytes_of(req), {}, {}, &rep, nullptr));
  if (!rep.empty()) {  // the spec echoes the entry; tolerate servers that send nothing
    if (rep.size() < sizeof(vu::DmaUnmap) || load<vu::DmaUnmap>(rep).addr != bus_addr ||
        load<vu::DmaUnmap>(rep).size != size) {
      return Status::error(Code::protocol_error, "vfio-user %s: DMA_UNMAP reply does not match", _path.c_str());
    }
  }
  _dma.erase(it);
  return Status::ok();
}

// The server (hcomm-sim) sends nothing unasked: a readable socket between
// requests is the server hanging up (EOF), or a stream in an unknown state.
Status VfioUserLink::health() {
  std::unique_lock lk(_mu, std::try_to_lock);
  if (!lk.owns_lock()) return Status::ok();  // a request is in flight: it will see a hang-up itself
  if (!_broken.is_ok()) return Status::error(Code::device_error, "%s", _broken.message().c_str());
  pollfd pf{_sock.get(), POLLIN | POLLRDHUP, 0};
  if (::poll(&pf, 1, 0) <= 0) return Status::ok();
  if (pf.revents & (POLLHUP | POLLRDHUP | POLLERR))
    return broken(Status::error(Code::device_error,
                                "vfio-user %s: the device's server hung up (hcomm-sim exited or was killed)",
                                _path.c_str()));
  char c;
  ssize_t n = ::recv(_sock.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0)
    return broken(Status::error(Code::device_error,
                                "vfio-user %s: the device's server hung up (hcomm-sim exited or was killed)",
                                _path.c_str()));
  if (n > 0)
    return broken(Status::error(Code::device_error, "vfio-user %s: the server sent a message nobody asked for",
                                _path.c_str()));
  return Status::ok();
}

Status VfioUserLink::reset() {
  std::lock_guard lk(_mu);
  return transact(vu::Command::DEVICE_RESET, {}, {}, {}, nullptr, nullptr);
}

}  // namespace

Status open_vfio_user(const std::string& socket_path, std::unique_ptr<Link>* out, int timeout_ms) {
  if (timeout_ms <= 0) return Status::error(Code::invalid_argument, "timeout must be > 0 ms");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof addr.sun_path) {
    return Status::error(Code::invalid_argument, "socket path '%s' is empty or too long", socket_path.c_str());
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock.valid()) return Status::from_errno(errno, "socket(AF_UNIX)");

  Deadline dl = Deadline::after_ms(timeout_ms);
  for (;;) {
    if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    int e = errno;
    if (e == EINTR) continue;
    // EAGAIN: the server's backlog is full (it serves one client at a time).
    if (e == EAGAIN && !dl.expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    Code c = e == ENOENT ? Code::not_found
             : e == ECONNREFUSED ? Code::peer_failure
             : e == EAGAIN ? Code::timeout
                           : Code::io_error;
    return Status::error(c, "connect %s: %s", socket_path.c_str(), std::strerror(e));
  }
  auto link = std::make_unique<VfioUserLink>(socket_path, std::move(sock), timeout_ms);
  HCOMM_TRY(link->init());
  *out = std::move(link);
  return Status::ok();
}

}  // namespace hcomm::driver
