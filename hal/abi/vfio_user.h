// vfio-user wire format: the subset hcomm speaks, declared once for both ends
// (driver/vfio_user_link.cpp is the client, sim/vfio_user_server.cpp the server).
//
// Protocol: QEMU docs/interop/vfio-user.rst ("vfio-user Protocol
// Specification"), protocol version 0.1. Section names below refer to it.
// All fields are in host byte order (the protocol is same-host over AF_UNIX);
// every struct is packed-by-construction (natural alignment, no padding) and
// its layout is pinned by static_asserts. File descriptors travel as
// SCM_RIGHTS ancillary data attached to the first byte of a message.
//
// Flag and index constants that <linux/vfio.h> already defines with the same
// meaning (region/irq indices, VFIO_REGION_INFO_FLAG_*, VFIO_IRQ_SET_*, ...)
// are used from there, not redefined; the message structs are ours.
#pragma once

#include <linux/vfio.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace hcomm::hal::abi::vfio_user {

// ---- "VFIO_USER_VERSION" -----------------------------------------------------
inline constexpr uint16_t kVersionMajor = 0;
inline constexpr uint16_t kVersionMinor = 1;

// ---- "Commands" ----------------------------------------------------------------
// Commands we implement. DMA_READ/WRITE (11/12, server -> client) are never
// needed because every DMA_MAP carries an fd; DIRTY_PAGES / migration are
// not supported (the server answers ENOSYS).
enum class Command : uint16_t {
  VERSION = 1,
  DMA_MAP = 2,
  DMA_UNMAP = 3,
  DEVICE_GET_INFO = 4,
  DEVICE_GET_REGION_INFO = 5,
  DEVICE_GET_REGION_IO_FDS = 6,
  DEVICE_GET_IRQ_INFO = 7,
  DEVICE_SET_IRQS = 8,
  REGION_READ = 9,
  REGION_WRITE = 10,
  DEVICE_RESET = 13,
};

inline constexpr const char* command_name(uint16_t cmd) {
  switch (static_cast<Command>(cmd)) {
    case Command::VERSION: return "VERSION";
    case Command::DMA_MAP: return "DMA_MAP";
    case Command::DMA_UNMAP: return "DMA_UNMAP";
    case Command::DEVICE_GET_INFO: return "DEVICE_GET_INFO";
    case Command::DEVICE_GET_REGION_INFO: return "DEVICE_GET_REGION_INFO";
    case Command::DEVICE_GET_REGION_IO_FDS: return "DEVICE_GET_REGION_IO_FDS";
    case Command::DEVICE_GET_IRQ_INFO: return "DEVICE_GET_IRQ_INFO";
    case Command::DEVICE_SET_IRQS: return "DEVICE_SET_IRQS";
    case Command::REGION_READ: return "REGION_READ";
    case Command::REGION_WRITE: return "REGION_WRITE";
    case Command::DEVICE_RESET: return "DEVICE_RESET";
  }
  return "UNKNOWN";
}

// ---- "Header" ------------------------------------------------------------------
namespace msg_flag {
inline constexpr uint32_t TYPE_MASK = 0xfu;    // bits 0-3
inline constexpr uint32_t TYPE_COMMAND = 0x0u;
inline constexpr uint32_t TYPE_REPLY = 0x1u;
inline constexpr uint32_t NO_REPLY = 1u << 4;  // command: the sender wants no reply
inline constexpr uint32_t ERROR = 1u << 5;     // reply: error_no is valid
inline constexpr uint32_t kKnown = TYPE_MASK | NO_REPLY | ERROR;
}  // namespace msg_flag

struct Header {
  uint16_t msg_id;    // chosen by the sender, echoed in the reply
  uint16_t command;   // Command; also set in the reply
  uint32_t msg_size;  // whole message, header included
  uint32_t flags;     // msg_flag bits
  uint32_t error_no;  // reply with ERROR: a UNIX errno (may be 0); reserved in commands
};
static_assert(sizeof(Header) == 16);
static_assert(offsetof(Header, command) == 2);
static_assert(offsetof(Header, msg_size) == 4);
static_assert(offsetof(Header, flags) == 8);
static_assert(offsetof(Header, error_no) == 12);

// ---- size limits ---------------------------------------------------------------
// Largest `count` of one REGION_READ/WRITE we accept and advertise
// (max_data_xfer_size; the spec default is the same 1 MiB).
inline constexpr uint32_t kMaxDataXferSize = 1u << 20;
// Most fds we accept in one message (max_msg_fds) and the spec default for a
// peer that does not say.
inline constexpr uint32_t kMaxMsgFds = 16;
inline constexpr uint32_t kDefaultPeerMaxMsgFds = 1;
// Largest message either end accepts: a full data transfer plus its headers.
// Anything bigger is a malformed header (the receiver drops the peer, since it
// cannot resynchronise the stream without reading the whole body).
inline constexpr uint32_t kMaxMsgSize = kMaxDataXferSize + 16 + 16;

// ---- "VFIO_USER_VERSION" payload -------------------------------------------------
// Followed by an optional NUL-terminated UTF-8 JSON object:
//   {"capabilities":{"max_msg_fds":N,"max_data_xfer_size":N}}
// (we never negotiate migration).
struct Version {
  uint16_t major;
  uint16_t minor;
};
static_assert(sizeof(Version) == 4);
static_assert(offsetof(Version, minor) == 2);

// ---- "VFIO_USER_DMA_MAP" ---------------------------------------------------------
namespace dma_flag {
inline constexpr uint32_t READ = 1u << 0;   // the device may read the region
inline constexpr uint32_t WRITE = 1u << 1;  // the device may write the region
inline constexpr uint32_t kKnown = READ | WRITE;
}  // namespace dma_flag

// Request: exactly one fd (we do not support fd-less, DMA_READ-backed maps).
// argsz = sizeof(DmaMap). Reply: no payload.
struct DmaMap {
  uint32_t argsz;
  uint32_t flags;   // dma_flag bits
  uint64_t offset;  // offset of the region in the fd
  uint64_t addr;    // DMA (bus) address
  uint64_t size;
};
static_assert(sizeof(DmaMap) == 32);
static_assert(offsetof(DmaMap, flags) == 4);
static_assert(offsetof(DmaMap, offset) == 8);
static_assert(offsetof(DmaMap, addr) == 16);
static_assert(offsetof(DmaMap, size) == 24);

// ---- "VFIO_USER_DMA_UNMAP" -------------------------------------------------------
// Request: argsz = largest reply payload accepted (>= sizeof); flags must be 0
// (no dirty bitmap). addr/size must match one earlier DMA_MAP exactly.
// Reply: the same struct echoed.
struct DmaUnmap {
  uint32_t argsz;
  uint32_t flags;
  uint64_t addr;
  uint64_t size;
};
static_assert(sizeof(DmaUnmap) == 24);
static_assert(offsetof(DmaUnmap, addr) == 8);
static_assert(offsetof(DmaUnmap, size) == 16);

// ---- "VFIO_USER_DEVICE_GET_INFO" -------------------------------------------------
// flags: VFIO_DEVICE_FLAGS_RESET | VFIO_DEVICE_FLAGS_PCI.
struct DeviceInfo {
  uint32_t argsz;
  uint32_t flags;
  uint32_t num_regions;
  uint32_t num_irqs;
};
static_assert(sizeof(DeviceInfo) == 16);
static_assert(offsetof(DeviceInfo, num_irqs) == 12);

// ---- "VFIO_USER_DEVICE_GET_REGION_INFO" -----------------------------------------
// The layout of struct vfio_region_info. flags: VFIO_REGION_INFO_FLAG_READ /
// _WRITE / _MMAP. A reply with _MMAP carries exactly one fd: the region is
// mmap(fd, size, offset).
struct RegionInfo {
  uint32_t argsz;
  uint32_t flags;
  uint32_t index;
  uint32_t cap_offset;  // 0: we send no region capabilities
  uint64_t size;
  uint64_t offset;      // mmap offset in the reply's fd
};
static_assert(sizeof(RegionInfo) == 32);
static_assert(sizeof(RegionInfo) == sizeof(struct vfio_region_info));
static_assert(offsetof(RegionInfo, index) == offsetof(struct vfio_region_info, index));
static_assert(offsetof(RegionInfo, cap_offset) == offsetof(struct vfio_region_info, cap_offset));
static_assert(offsetof(RegionInfo, size) == offsetof(struct vfio_region_info, size));
static_assert(offsetof(RegionInfo, offset) == offsetof(struct vfio_region_info, offset));

// Region indices as VFIO PCI (<linux/vfio.h>).
inline constexpr uint32_t kRegionBar0 = VFIO_PCI_BAR0_REGION_INDEX;
inline constexpr uint32_t kRegionBar2 = VFIO_PCI_BAR2_REGION_INDEX;
inline constexpr uint32_t kRegionConfig = VFIO_PCI_CONFIG_REGION_INDEX;
inline constexpr uint32_t kNumRegions = VFIO_PCI_NUM_REGIONS;
inline constexpr uint64_t kConfigSize = 256;
static_assert(kRegionBar0 == 0 && kRegionBar2 == 2 && kRegionConfig == 7 && kNumRegions == 9);

// ---- "VFIO_USER_DEVICE_GET_REGION_IO_FDS" ----------------------------------------
// Request: argsz = largest reply payload accepted; flags 0; count 0.
// Reply: argsz = payload size needed (RegionIoFds + count * IoFdSubRegion).
// If the request's argsz is smaller, the reply carries only RegionIoFds (with
// the needed argsz and count) and no fds, so the client can retry.
struct RegionIoFds {
  uint32_t argsz;
  uint32_t flags;
  uint32_t index;
  uint32_t count;  // sub-regions that follow
};
static_assert(sizeof(RegionIoFds) == 16);
static_assert(offsetof(RegionIoFds, count) == 12);

inline constexpr uint32_t kIoFdTypeIoeventfd = 0;  // VFIO_USER_IO_FD_TYPE_IOEVENTFD
inline constexpr uint32_t kIoFdTypeIoregionfd = 1;

// One ioeventfd sub-region: a write of any value (no datamatch) to
// [offset, offset+size) of the region is signalled on fds[fd_index].
struct IoFdSubRegion {
  uint64_t offset;
  uint64_t size;
  uint32_t fd_index;
  uint32_t type;     // kIoFdTypeIoeventfd
  uint32_t flags;    // KVM_IOEVENTFD_FLAG_*; 0 = no datamatch, MMIO
  uint32_t padding;
  uint64_t datamatch;
};
static_assert(sizeof(IoFdSubRegion) == 40);
static_assert(offsetof(IoFdSubRegion, fd_index) == 16);
static_assert(offsetof(IoFdSubRegion, type) == 20);
static_assert(offsetof(IoFdSubRegion, flags) == 24);
static_assert(offsetof(IoFdSubRegion, datamatch) == 32);

// ---- "VFIO_USER_DEVICE_GET_IRQ_INFO" ---------------------------------------------
// The layout of struct vfio_irq_info. Index VFIO_PCI_MSIX_IRQ_INDEX reports
// VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE and count = vectors.
struct IrqInfo {
  uint32_t argsz;
  uint32_t flags;
  uint32_t index;
  uint32_t count;
};
static_assert(sizeof(IrqInfo) == 16);
static_assert(sizeof(IrqInfo) == sizeof(struct vfio_irq_info));
static_assert(offsetof(IrqInfo, count) == offsetof(struct vfio_irq_info, count));

inline constexpr uint32_t kIrqMsix = VFIO_PCI_MSIX_IRQ_INDEX;
inline constexpr uint32_t kNumIrqs = VFIO_PCI_NUM_IRQS;
static_assert(kIrqMsix == 2);

// ---- "VFIO_USER_DEVICE_SET_IRQS" -------------------------------------------------
// The header of struct vfio_irq_set; argsz = the whole request payload.
// We implement index MSIX with ACTION_TRIGGER and
//   DATA_EVENTFD: `count` fds attach vectors [start, start+count); zero fds
//                 detach them;
//   DATA_NONE with start = count = 0: detach every vector.
struct IrqSet {
  uint32_t argsz;
  uint32_t flags;  // one VFIO_IRQ_SET_DATA_* | one VFIO_IRQ_SET_ACTION_*
  uint32_t index;
  uint32_t start;
  uint32_t count;
};
static_assert(sizeof(IrqSet) == 20);
static_assert(offsetof(IrqSet, start) == offsetof(struct vfio_irq_set, start));
static_assert(offsetof(IrqSet, count) == offsetof(struct vfio_irq_set, count));

// ---- "VFIO_USER_REGION_READ" / "VFIO_USER_REGION_WRITE" ---------------------------
// READ request: exactly this struct. READ reply: this struct + count bytes.
// WRITE request: this struct + count bytes. WRITE reply: this struct.
struct RegionAccess {
  uint64_t offset;
  uint32_t region;
  uint32_t count;  // 1..max_data_xfer_size
};
static_assert(sizeof(RegionAccess) == 16);
static_assert(offsetof(RegionAccess, region) == 8);
static_assert(offsetof(RegionAccess, count) == 12);
static_assert(kMaxMsgSize == sizeof(Header) + sizeof(RegionAccess) + kMaxDataXferSize);

// ---- capabilities JSON -----------------------------------------------------------
// The two capabilities we negotiate; absent ones keep the spec defaults.
struct Caps {
  uint64_t max_msg_fds = kDefaultPeerMaxMsgFds;
  uint64_t max_data_xfer_size = kMaxDataXferSize;
};

// {"capabilities":{"max_msg_fds":N,"max_data_xfer_size":N}} (no NUL).
inline std::string caps_json(const Caps& c) {
  char buf[128];
  int n = std::snprintf(buf, sizeof buf,
                        "{\"capabilities\":{\"max_msg_fds\":%llu,\"max_data_xfer_size\":%llu}}",
                        static_cast<unsigned long long>(c.max_msg_fds),
                        static_cast<unsigned long long>(c.max_data_xfer_size));
  return std::string(buf, n > 0 ? static_cast<size_t>(n) : 0);
}

// A strict little JSON reader for the version data: validates the whole
// document (any JSON value is skipped correctly, e.g. QEMU's "migration"
// object), then takes max_msg_fds / max_data_xfer_size from the top-level
// "capabilities" object when they are non-negative integers. Returns false on
// malformed JSON or a capability of the wrong type. Nesting is bounded so a
// hostile peer cannot exhaust the stack.
class CapsParser {
 public:
  static bool parse(std::string_view text, Caps* out) {
    CapsParser p(text);
    Caps caps = *out;
    p.ws();
    if (!p.top_object(&caps)) return false;
    p.ws();
    if (p._pos != p._s.size()) return false;
    *out = caps;
    return true;
  }

 private:
  explicit CapsParser(std::string_view s) : _s(s) {}

  static constexpr int kMaxDepth = 16;

  bool eof() const { return _pos >= _s.size(); }
  char peek() const { return eof() ? '\0' : _s[_pos]; }
  void ws() {
    while (!eof() && (_s[_pos] == ' ' || _s[_pos] == '\t' || _s[_pos] == '\n' || _s[_pos] == '\r')) ++_pos;
  }
  bool lit(char c) {
    ws();
    if (peek() != c) return false;
    ++_pos;
    return true;
  }
  bool str(std::string* out) {
    ws();
    if (peek() != '"') return false;
    ++_pos;
    while (!eof()) {
      char c = _s[_pos++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c == '\\') {
        if (eof()) return false;
        char e = _s[_pos++];
        if (e == 'u') {
          for (int i = 0; i < 4; ++i) {
            if (eof() || !is_hex(_s[_pos])) return false;
            ++_pos;
          }
          if (out) out->push_back('?');  // keys we look for are plain ASCII
          continue;
        }
        if (e != '"' && e != '\\' && e != '/' && e != 'b' && e != 'f' && e != 'n' && e != 'r' && e != 't') {
          return false;
        }
        if (out) out->push_back(e);
        continue;
      }
      if (out) out->push_back(c);
    }
    return false;
  }
  static bool is_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
  }
  static bool is_digit(char c) { return c >= '0' && c <= '9'; }
  // A JSON number; *is_uint/*value describe it when it is a plain
  // non-negative integer that fits 64 bits.
  bool number(bool* is_uint, uint64_t* value) {
    ws();
    size_t start = _pos;
    bool neg = false, integral = true, overflow = false;
    uint64_t v = 0;
    if (peek() == '-') { neg = true; ++_pos; }
    if (!is_digit(peek())) return false;
    if (peek() == '0') {
      ++_pos;
    } else {
      while (is_digit(peek())) {
        uint64_t d = static_cast<uint64_t>(_s[_pos] - '0');
        if (v > (UINT64_MAX - d) / 10) overflow = true;
        v = v * 10 + d;
        ++_pos;
      }
    }
    if (peek() == '.') {
      integral = false;
      ++_pos;
      if (!is_digit(peek())) return false;
      while (is_digit(peek())) ++_pos;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++_pos;
      if (peek() == '+' || peek() == '-') ++_pos;
      if (!is_digit(peek())) return false;
      while (is_digit(peek())) ++_pos;
    }
    *is_uint = !neg && integral && !overflow && _pos > start;
    *value = v;
    return true;
  }
  bool word(std::string_view w) {
    ws();
    if (_s.substr(_pos, w.size()) != w) return false;
    _pos += w.size();
    return true;
  }
  bool value(int depth) {
    if (depth > kMaxDepth) return false;
    ws();
    switch (peek()) {
      case '{': {
        ++_pos;
        if (lit('}')) return true;
        do {
          if (!str(nullptr) || !lit(':') || !value(depth + 1)) return false;
        } while (lit(','));
        return lit('}');
      }
      case '[': {
        ++_pos;
        if (lit(']')) return true;
        do {
          if (!value(depth + 1)) return false;
        } while (lit(','));
        return lit(']');
      }
      case '"': return str(nullptr);
      case 't': return word("true");
      case 'f': return word("false");
      case 'n': return word("null");
      default: {
        bool u;
        uint64_t v;
        return number(&u, &v);
      }
    }
  }
  bool caps_object(Caps* caps) {
    if (!lit('{')) return false;
    if (lit('}')) return true;
    do {
      std::string key;
      if (!str(&key) || !lit(':')) return false;
      if (key == "max_msg_fds" || key == "max_data_xfer_size") {
        bool u;
        uint64_t v;
        if (!number(&u, &v) || !u) return false;
        (key == "max_msg_fds" ? caps->max_msg_fds : caps->max_data_xfer_size) = v;
      } else if (!value(2)) {
        return false;
      }
    } while (lit(','));
    return lit('}');
  }
  bool top_object(Caps* caps) {
    if (!lit('{')) return false;
    if (lit('}')) return true;
    do {
      std::string key;
      if (!str(&key) || !lit(':')) return false;
      if (key == "capabilities") {
        if (!caps_object(caps)) return false;
      } else if (!value(1)) {
        return false;
      }
    } while (lit(','));
    return lit('}');
  }

  std::string_view _s;
  size_t _pos = 0;
};

}  // namespace hcomm::hal::abi::vfio_user
