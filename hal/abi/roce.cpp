// The RoCEv2 wire format (roce.h): opcode table, frame encoding and
// decoding, ICRC. The ICRC is the standard CRC-32 (zlib's crc32_z: chains
// across the masked header copy and the frame's own bytes, table-driven).
#include "hal/abi/roce.h"
#include "hal/abi/rdma.h"

#include <zlib.h>

#include <array>
#include <cstdio>
#include <cstring>

namespace hcomm::hal::abi::roce {

namespace {

constexpr std::array<uint16_t, 256> make_table() {
  using namespace hdr;
  std::array<uint16_t, 256> t{};
  auto set = [&](Op op, uint16_t f) { t[static_cast<uint8_t>(op)] = static_cast<uint16_t>(f | KNOWN); };
  set(Op::SEND_FIRST, REQUEST | FIRST | PAYLOAD);
  set(Op::SEND_MIDDLE, REQUEST | MIDDLE | PAYLOAD);
  set(Op::SEND_LAST, REQUEST | LAST | PAYLOAD);
  set(Op::SEND_LAST_IMM, REQUEST | LAST | IMM | PAYLOAD);
  set(Op::SEND_ONLY, REQUEST | ONLY | PAYLOAD);
  set(Op::SEND_ONLY_IMM, REQUEST | ONLY | IMM | PAYLOAD);
  set(Op::WRITE_FIRST, REQUEST | FIRST | RETH | PAYLOAD);
  set(Op::WRITE_MIDDLE, REQUEST | MIDDLE | PAYLOAD);
  set(Op::WRITE_LAST, REQUEST | LAST | PAYLOAD);
  set(Op::WRITE_LAST_IMM, REQUEST | LAST | IMM | PAYLOAD);
  set(Op::WRITE_ONLY, REQUEST | ONLY | RETH | PAYLOAD);
  set(Op::WRITE_ONLY_IMM, REQUEST | ONLY | RETH | IMM | PAYLOAD);
  set(Op::READ_REQUEST, REQUEST | ONLY | RETH);
  set(Op::READ_RESPONSE_FIRST, RESPONSE | FIRST | AETH | PAYLOAD);
  set(Op::READ_RESPONSE_MIDDLE, RESPONSE | MIDDLE | PAYLOAD);
  set(Op::READ_RESPONSE_LAST, RESPONSE | LAST | AETH | PAYLOAD);
  set(Op::READ_RESPONSE_ONLY, RESPONSE | ONLY | AETH | PAYLOAD);
  set(Op::ACKNOWLEDGE, RESPONSE | ONLY | AETH);
  set(Op::ATOMIC_ACKNOWLEDGE, RESPONSE | ONLY | AETH | ATOMIC_ACK);
  set(Op::COMPARE_SWAP, REQUEST | ONLY | ATOMIC_ETH);
  set(Op::FETCH_ADD, REQUEST | ONLY | ATOMIC_ETH);
  set(Op::WRITE_REDUCE_FIRST, REQUEST | FIRST | RETH | REDUCE_ETH | PAYLOAD);
  set(Op::WRITE_REDUCE_MIDDLE, REQUEST | MIDDLE | PAYLOAD);
  set(Op::WRITE_REDUCE_LAST, REQUEST | LAST | PAYLOAD);
  set(Op::WRITE_REDUCE_ONLY, REQUEST | ONLY | RETH | REDUCE_ETH | PAYLOAD);
  return t;
}
constexpr std::array<uint16_t, 256> kOps = make_table();

// Offsets inside the frame.
constexpr size_t kIp = kEthLen, kUdp = kIp + kIpv4Len, kBth = kUdp + kUdpLen, kExt = kBth + kBthLen;
static_assert(kBth == 42 && kExt == 54);
static_assert(kAtomicEthLen == 8 + 4 + 8 + 8 && kRethLen == 8 + 4 + 4);

// One's-complement sum of 16-bit big-endian words.
uint32_t sum16(const uint8_t* p, size_t n, uint32_t acc) {
  for (size_t i = 0; i + 1 < n; i += 2) acc += get16(p + i);
  if (n & 1) acc += uint32_t{p[n - 1]} << 8;
  return acc;
}
uint16_t fold(uint32_t acc) {
  while (acc >> 16) acc = (acc & 0xffff) + (acc >> 16);
  return static_cast<uint16_t>(~acc);
}

// UDP checksum over the IPv4 pseudo header (RFC 768); a result of 0 is sent as 0xffff.
uint16_t udp_checksum(const uint8_t* ip, const uint8_t* udp, size_t udp_len) {
  uint32_t acc = sum16(ip + 12, 8, 0) + 17 + static_cast<uint32_t>(udp_len);
  acc = sum16(udp, 6, acc);  // the checksum field counts as zero
  acc = sum16(udp + 8, udp_len - 8, acc);
  uint16_t c = fold(acc);
  return c == 0 ? 0xffff : c;
}

}  // namespace

uint16_t op_headers(uint8_t opcode) { return kOps[opcode]; }

const char* op_name(uint8_t opcode) {
  switch (static_cast<Op>(opcode)) {
    case Op::SEND_FIRST: return "SEND_FIRST";
    case Op::SEND_MIDDLE: return "SEND_MIDDLE";
    case Op::SEND_LAST: return "SEND_LAST";
    case Op::SEND_LAST_IMM: return "SEND_LAST_WITH_IMMEDIATE";
    case Op::SEND_ONLY: return "SEND_ONLY";
    case Op::SEND_ONLY_IMM: return "SEND_ONLY_WITH_IMMEDIATE";
    case Op::WRITE_FIRST: return "RDMA_WRITE_FIRST";
    case Op::WRITE_MIDDLE: return "RDMA_WRITE_MIDDLE";
    case Op::WRITE_LAST: return "RDMA_WRITE_LAST";
    case Op::WRITE_LAST_IMM: return "RDMA_WRITE_LAST_WITH_IMMEDIATE";
    case Op::WRITE_ONLY: return "RDMA_WRITE_ONLY";
    case Op::WRITE_ONLY_IMM: return "RDMA_WRITE_ONLY_WITH_IMMEDIATE";
    case Op::READ_REQUEST: return "RDMA_READ_REQUEST";
    case Op::READ_RESPONSE_FIRST: return "RDMA_READ_RESPONSE_FIRST";
    case Op::READ_RESPONSE_MIDDLE: return "RDMA_READ_RESPONSE_MIDDLE";
    case Op::READ_RESPONSE_LAST: return "RDMA_READ_RESPONSE_LAST";
    case Op::READ_RESPONSE_ONLY: return "RDMA_READ_RESPONSE_ONLY";
    case Op::ACKNOWLEDGE: return "ACKNOWLEDGE";
    case Op::ATOMIC_ACKNOWLEDGE: return "ATOMIC_ACKNOWLEDGE";
    case Op::COMPARE_SWAP: return "COMPARE_SWAP";
    case Op::FETCH_ADD: return "FETCH_ADD";
    case Op::WRITE_REDUCE_FIRST: return "WRITE_REDUCE_FIRST";
    case Op::WRITE_REDUCE_MIDDLE: return "WRITE_REDUCE_MIDDLE";
    case Op::WRITE_REDUCE_LAST: return "WRITE_REDUCE_LAST";
    case Op::WRITE_REDUCE_ONLY: return "WRITE_REDUCE_ONLY";
  }
  return "unknown";
}

size_t ext_len(uint16_t h) {
  size_t n = 0;
  if (h & hdr::RETH) n += kRethLen;
  if (h & hdr::ATOMIC_ETH) n += kAtomicEthLen;
  if (h & hdr::AETH) n += kAethLen;
  if (h & hdr::ATOMIC_ACK) n += kAtomicAckLen;
  if (h & hdr::REDUCE_ETH) n += kReduceEthLen;
  if (h & hdr::IMM) n += kImmLen;
  return n;
}

const char* parse_error_name(ParseError e) {
  switch (e) {
    case ParseError::ok: return "ok";
    case ParseError::truncated: return "truncated";
    case ParseError::not_roce: return "not RoCEv2";
    case ParseError::bad_ip: return "bad IPv4 header";
    case ParseError::bad_udp: return "bad UDP header";
    case ParseError::bad_bth: return "bad BTH";
    case ParseError::bad_length: return "bad payload length";
    case ParseError::bad_icrc: return "bad ICRC";
    case ParseError::unsupported: return "unsupported opcode";
  }
  return "?";
}

uint16_t ipv4_checksum(const uint8_t* ip) { return fold(sum16(ip, kIpv4Len, 0)); }

uint32_t icrc(const uint8_t* frame, size_t len) {
  // The masked copy of IPv4 | UDP | BTH behind 8 bytes of ones, then the
  // frame's own bytes from the first extension header to the ICRC field.
  uint8_t m[8 + kIpv4Len + kUdpLen + kBthLen];
  std::memset(m, 0xff, 8);
  std::memcpy(m + 8, frame + kIp, kIpv4Len + kUdpLen + kBthLen);
  uint8_t* ip = m + 8;
  ip[1] = 0xff;                // TOS (DSCP | ECN)
  ip[8] = 0xff;                // TTL
  ip[10] = ip[11] = 0xff;      // header checksum
  uint8_t* udp = ip + kIpv4Len;
  udp[6] = udp[7] = 0xff;      // UDP checksum
  udp[kUdpLen + bth::kMaskedByte] = 0xff;  // FECN | BECN | resv6
  uLong c = crc32_z(0, m, sizeof m);
  c = crc32_z(c, frame + kExt, len - kIcrcLen - kExt);
  return static_cast<uint32_t>(c);
}

ParseError parse(const uint8_t* f, size_t len, Packet* out) {
  Packet p;
  if (len < kEthLen) return ParseError::truncated;
  if (get16(f + 12) != kEtherIPv4) return ParseError::not_roce;
  if (len < kUdp) return ParseError::truncated;
  const uint8_t* ip = f + kIp;
  if (ip[0] != 0x45) return ParseError::bad_ip;  // IPv4 without options
  if (ip[9] != 17) return ParseError::not_roce;  // not UDP
  if ((get16(ip + 6) & 0x3fff) != 0) return ParseError::bad_ip;  // a fragment (MF or offset)
  const size_t ip_len = get16(ip + 2);
  if (ip_len < kIpv4Len + kUdpLen) return ParseError::bad_ip;
  if (ip_len > len - kIp) return ParseError::truncated;  // (an Ethernet pad beyond it is ignored)
  if (ipv4_checksum(ip) != 0) return ParseError::bad_ip;
  const uint8_t* udp = ip + kIpv4Len;
  if (get16(udp + 2) != kUdpPort) return ParseError::not_roce;
  const size_t udp_len = get16(udp + 4);
  if (udp_len != ip_len - kIpv4Len) return ParseError::bad_udp;
  if (udp_len < kUdpLen + kBthLen + kIcrcLen) return ParseError::truncated;
  // The ICRC first: a corrupted byte anywhere it covers is a bad ICRC,
  // whichever field it hit.
  const size_t flen = kIp + ip_len;  // the frame without an Ethernet pad
  const uint8_t* ic = f + flen - kIcrcLen;
  const uint32_t want = uint32_t{ic[0]} | uint32_t{ic[1]} << 8 | uint32_t{ic[2]} << 16 | uint32_t{ic[3]} << 24;
  if (icrc(f, flen) != want) return ParseError::bad_icrc;
  if (get16(udp + 6) != 0 && udp_checksum(ip, udp, udp_len) != get16(udp + 6)) return ParseError::bad_udp;

  std::memcpy(p.dst_mac, f, 6);
  std::memcpy(p.src_mac, f + 6, 6);
  p.tos = ip[1];
  p.ip_id = get16(ip + 4);
  p.ttl = ip[8];
  p.src_ip = get32(ip + 12);
  p.dst_ip = get32(ip + 16);
  p.udp_src = get16(udp);

  const uint8_t* b = f + kBth;
  p.opcode = b[0];
  p.se = b[1] & bth::SE;
  p.migreq = b[1] & bth::MIGREQ;
  p.pad = (b[1] & bth::PAD_MASK) >> bth::PAD_SHIFT;
  if ((b[1] & bth::TVER_MASK) != 0) return ParseError::bad_bth;
  p.pkey = get16(b + 2);
  p.fecn = b[4] & bth::FECN;
  p.becn = b[4] & bth::BECN;
  p.dest_qp = get24(b + 5);
  p.ack_req = b[8] & bth::ACKREQ;
  p.psn = get24(b + 9);
  const uint16_t h = kOps[p.opcode];
  if (h == 0) return ParseError::unsupported;
  const size_t ext = ext_len(h);
  const size_t body = udp_len - kUdpLen - kBthLen - kIcrcLen;  // extension headers + payload + pad
  if (body < ext) return ParseError::truncated;
  const uint8_t* e = f + kExt;
  if (h & hdr::RETH) {
    p.va = get64(e);
    p.rkey = get32(e + 8);
    p.dma_len = get32(e + 12);
    e += kRethLen;
  }
  if (h & hdr::ATOMIC_ETH) {
    p.va = get64(e);
    p.rkey = get32(e + 8);
    p.swap_add = get64(e + 12);
    p.compare = get64(e + 20);
    e += kAtomicEthLen;
  }
  if (h & hdr::AETH) {
    p.syndrome = e[0];
    p.msn = get24(e + 1);
    e += kAethLen;
  }
  if (h & hdr::ATOMIC_ACK) {
    p.orig = get64(e);
    e += kAtomicAckLen;
  }
  if (h & hdr::REDUCE_ETH) {
    p.dtype = e[0];
    p.redop = e[1];
    if (e[2] != 0 || e[3] != 0) return ParseError::bad_bth;  // reserved
    e += kReduceEthLen;
  }
  if (h & hdr::IMM) {
    p.imm = get32(e);
    e += kImmLen;
  }
  const size_t data = body - ext;  // payload + pad
  if (!(h & hdr::PAYLOAD)) {
    if (data != 0 || p.pad != 0) return ParseError::bad_length;
  } else {
    if (data % 4 != 0 || data < p.pad) return ParseError::bad_length;
    p.payload = e;
    p.payload_len = static_cast<uint32_t>(data - p.pad);
  }
  *out = p;
  return ParseError::ok;
}

size_t build(const Packet& p, const uint8_t* payload, uint8_t* out, size_t cap) {
  const uint16_t h = kOps[p.opcode];
  if (h == 0) return 0;
  if (!(h & hdr::PAYLOAD) && p.payload_len != 0) return 0;
  if (p.payload_len > 0 && payload == nullptr) return 0;
  const size_t pad = (4 - p.payload_len % 4) % 4;
  const size_t ext = ext_len(h);
  const size_t udp_len = kUdpLen + kBthLen + ext + p.payload_len + pad + kIcrcLen;
  const size_t total = kIp + kIpv4Len + udp_len;
  if (udp_len > 0xffff - kIpv4Len || total > cap) return 0;
  uint8_t* f = out;
  std::memcpy(f, p.dst_mac, 6);
  std::memcpy(f + 6, p.src_mac, 6);
  put16(f + 12, kEtherIPv4);
  uint8_t* ip = f + kIp;
  ip[0] = 0x45;
  ip[1] = p.tos;
  put16(ip + 2, static_cast<uint16_t>(kIpv4Len + udp_len));
  put16(ip + 4, p.ip_id);
  put16(ip + 6, 0x4000);  // don't fragment
  ip[8] = p.ttl;
  ip[9] = 17;
  put16(ip + 10, 0);
  put32(ip + 12, p.src_ip);
  put32(ip + 16, p.dst_ip);
  put16(ip + 10, ipv4_checksum(ip));
  uint8_t* udp = ip + kIpv4Len;
  put16(udp, p.udp_src);
  put16(udp + 2, kUdpPort);
  put16(udp + 4, static_cast<uint16_t>(udp_len));
  put16(udp + 6, 0);  // no UDP checksum (the ICRC covers the transport; rxe sends 0 too)
  uint8_t* b = f + kBth;
  b[0] = p.opcode;
  b[1] = static_cast<uint8_t>((p.se ? bth::SE : 0) | (p.migreq ? bth::MIGREQ : 0) | pad << bth::PAD_SHIFT);
  put16(b + 2, p.pkey);
  b[4] = static_cast<uint8_t>((p.fecn ? bth::FECN : 0) | (p.becn ? bth::BECN : 0));
  put24(b + 5, p.dest_qp & kPsnMask);
  b[8] = p.ack_req ? bth::ACKREQ : 0;
  put24(b + 9, p.psn & kPsnMask);
  uint8_t* e = f + kExt;
  if (h & hdr::RETH) {
    put64(e, p.va);
    put32(e + 8, p.rkey);
    put32(e + 12, p.dma_len);
    e += kRethLen;
  }
  if (h & hdr::ATOMIC_ETH) {
    put64(e, p.va);
    put32(e + 8, p.rkey);
    put64(e + 12, p.swap_add);
    put64(e + 20, p.compare);
    e += kAtomicEthLen;
  }
  if (h & hdr::AETH) {
    e[0] = p.syndrome;
    put24(e + 1, p.msn & kPsnMask);
    e += kAethLen;
  }
  if (h & hdr::ATOMIC_ACK) {
    put64(e, p.orig);
    e += kAtomicAckLen;
  }
  if (h & hdr::REDUCE_ETH) {
    e[0] = p.dtype;
    e[1] = p.redop;
    e[2] = e[3] = 0;
    e += kReduceEthLen;
  }
  if (h & hdr::IMM) {
    put32(e, p.imm);
    e += kImmLen;
  }
  if (p.payload_len > 0) std::memcpy(e, payload, p.payload_len);
  e += p.payload_len;
  std::memset(e, 0, pad);
  e += pad;
  const uint32_t c = icrc(f, total);
  e[0] = static_cast<uint8_t>(c);
  e[1] = static_cast<uint8_t>(c >> 8);
  e[2] = static_cast<uint8_t>(c >> 16);
  e[3] = static_cast<uint8_t>(c >> 24);
  return total;
}

std::string mac_string(const uint8_t* m) {
  char s[18];
  std::snprintf(s, sizeof s, "%02x:%02x:%02x:%02x:%02x:%02x", m[0], m[1], m[2], m[3], m[4], m[5]);
  return s;
}

std::string ip_string(uint32_t ip) {
  char s[16];
  std::snprintf(s, sizeof s, "%u.%u.%u.%u", ip >> 24, (ip >> 16) & 0xff, (ip >> 8) & 0xff, ip & 0xff);
  return s;
}

}  // namespace hcomm::hal::abi::roce

namespace hcomm::hal::abi::rdma {

const char* wc_status_name(WcStatus s) {
  switch (s) {
    case WcStatus::SUCCESS: return "success";
    case WcStatus::LOC_LEN_ERR: return "local length error";
    case WcStatus::LOC_PROT_ERR: return "local protection error";
    case WcStatus::WR_FLUSH_ERR: return "flushed";
    case WcStatus::REM_INV_REQ_ERR: return "remote invalid request";
    case WcStatus::REM_ACCESS_ERR: return "remote access error";
    case WcStatus::REM_OP_ERR: return "remote operational error";
    case WcStatus::RETRY_EXC_ERR: return "retry count exceeded";
    case WcStatus::RNR_RETRY_EXC_ERR: return "RNR retry count exceeded";
    case WcStatus::BAD_WQE: return "malformed work request";
  }
  return "unknown status";
}

}  // namespace hcomm::hal::abi::rdma
