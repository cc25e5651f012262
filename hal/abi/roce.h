// The NPU RoCEv2 engine's wire format (docs/device-abi.md §14): the frames
// its ports send and accept, byte for byte as the InfiniBand Architecture
// Specification vol. 1 (release 1.4: §9.2-§9.4 headers, §9.7 reliable
// connection) and its RoCEv2 annex A17 lay them out, plus one vendor
// extension (WRITE_REDUCE, in the manufacturer-specific opcode range).
//
// A frame: Ethernet II (14) | IPv4 (20, no options) | UDP (8, dst 4791) |
// BTH (12) | extension headers by opcode | payload | pad to 4 | ICRC (4).
// Every multi-byte header field is big-endian; the ICRC is sent least-
// significant byte first. Fields are read and written through the offsets
// below (no packed structs): the one declaration the simulator's engine,
// the tests and the fuzz target share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hcomm::hal::abi::roce {

// ---- framing --------------------------------------------------------------------
inline constexpr uint16_t kUdpPort = 4791;     // RoCEv2 destination port (IANA)
inline constexpr uint16_t kEtherIPv4 = 0x0800;
inline constexpr uint16_t kEtherArp = 0x0806;
inline constexpr size_t kEthLen = 14, kIpv4Len = 20, kUdpLen = 8;
inline constexpr size_t kBthLen = 12, kRethLen = 16, kAethLen = 4, kAtomicEthLen = 28, kAtomicAckLen = 8,
                        kImmLen = 4, kReduceEthLen = 4, kIcrcLen = 4;
inline constexpr size_t kL2L4Len = kEthLen + kIpv4Len + kUdpLen;  // 42: where the BTH starts
// The largest frame: headers, the longest extension chain, a 4096-byte
// payload (the largest path MTU) and the ICRC.
inline constexpr size_t kMaxFrame = kL2L4Len + kBthLen + kRethLen + kReduceEthLen + kImmLen + 4096 + kIcrcLen;
inline constexpr uint16_t kDefaultPKey = 0xffff;  // the only partition RoCE devices (rxe) accept
inline constexpr uint8_t kDefaultTtl = 64;

// Path MTU: the payload bytes of one packet (IBA §9.6.2: 256..4096).
inline constexpr bool valid_pmtu(uint32_t m) { return m == 256 || m == 512 || m == 1024 || m == 2048 || m == 4096; }

// ---- BTH (IBA §9.2) ---------------------------------------------------------------
// byte 0 opcode; 1: SE 0x80 | MigReq 0x40 | PadCnt 0x30 | TVer 0x0f;
// 2-3 P_Key; 4: FECN 0x80 | BECN 0x40 | resv6 (the byte the ICRC masks);
// 5-7 DestQP; 8: AckReq 0x80 | resv7; 9-11 PSN.
namespace bth {
inline constexpr uint8_t SE = 0x80, MIGREQ = 0x40, PAD_SHIFT = 4, PAD_MASK = 0x30, TVER_MASK = 0x0f;
inline constexpr uint8_t FECN = 0x80, BECN = 0x40;
inline constexpr uint8_t ACKREQ = 0x80;
inline constexpr size_t kMaskedByte = 4;  // FECN/BECN/resv6: ones in the ICRC
}  // namespace bth
inline constexpr uint32_t kPsnMask = 0xffffff;  // PSNs and QP numbers are 24 bits
inline constexpr uint32_t psn_add(uint32_t psn, uint32_t n) { return (psn + n) & kPsnMask; }
// a - b in the 24-bit PSN space, as a signed distance in [-2^23, 2^23).
inline constexpr int32_t psn_diff(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(((a - b) & kPsnMask) << 8) >> 8;
}

// ---- opcodes: the reliable-connection set (IBA Table 38) and the vendor one -----
enum class Op : uint8_t {
  SEND_FIRST = 0x00,
  SEND_MIDDLE = 0x01,
  SEND_LAST = 0x02,
  SEND_LAST_IMM = 0x03,
  SEND_ONLY = 0x04,
  SEND_ONLY_IMM = 0x05,
  WRITE_FIRST = 0x06,
  WRITE_MIDDLE = 0x07,
  WRITE_LAST = 0x08,
  WRITE_LAST_IMM = 0x09,
  WRITE_ONLY = 0x0a,
  WRITE_ONLY_IMM = 0x0b,
  READ_REQUEST = 0x0c,
  READ_RESPONSE_FIRST = 0x0d,
  READ_RESPONSE_MIDDLE = 0x0e,
  READ_RESPONSE_LAST = 0x0f,
  READ_RESPONSE_ONLY = 0x10,
  ACKNOWLEDGE = 0x11,
  ATOMIC_ACKNOWLEDGE = 0x12,
  COMPARE_SWAP = 0x13,
  FETCH_ADD = 0x14,
  // Vendor extension (manufacturer-specific range 0xC0-0xFF): the target's
  // engine reduces the payload, element by element, into its memory at the
  // RETH address with the ReduceETH's dtype and operator. Sequenced like an
  // RDMA WRITE (FIRST/MIDDLE/LAST/ONLY, RETH and ReduceETH in FIRST/ONLY),
  // but not idempotent: a responder applies each PSN once (duplicates are
  // re-acknowledged, never re-applied; §14.3).
  WRITE_REDUCE_FIRST = 0xc0,
  WRITE_REDUCE_MIDDLE = 0xc1,
  WRITE_REDUCE_LAST = 0xc2,
  WRITE_REDUCE_ONLY = 0xc3,
};

// What follows the BTH, by opcode, in this order: RETH | AtomicETH | AETH |
// AtomicAckETH | ReduceETH | ImmDt | payload.
namespace hdr {
inline constexpr uint16_t RETH = 1u << 0, ATOMIC_ETH = 1u << 1, AETH = 1u << 2, ATOMIC_ACK = 1u << 3,
                          REDUCE_ETH = 1u << 4, IMM = 1u << 5, PAYLOAD = 1u << 6;
// Position in a multi-packet message.
inline constexpr uint16_t FIRST = 1u << 8, MIDDLE = 1u << 9, LAST = 1u << 10, ONLY = FIRST | LAST;
inline constexpr uint16_t REQUEST = 1u << 12, RESPONSE = 1u << 13;
inline constexpr uint16_t KNOWN = 1u << 15;  // an opcode this engine speaks
}  // namespace hdr
// hdr:: flags of an opcode; 0 for one this engine does not speak (UD, UC,
// XRC, SEND with invalidate, and the rest of the manufacturer range).
uint16_t op_headers(uint8_t opcode);
const char* op_name(uint8_t opcode);
// Bytes of extension headers after the BTH.
size_t ext_len(uint16_t headers);

// ---- AETH syndromes (IBA §9.4.4) ---------------------------------------------------
namespace aeth {
inline constexpr uint8_t ACK = 0x00;          // | credit count (5 bits); 0x1f: no credits
inline constexpr uint8_t RNR_NAK = 0x20;      // | RNR timer code (5 bits)
inline constexpr uint8_t NAK = 0x60;          // | NAK code:
inline constexpr uint8_t NAK_PSN_SEQ = 0x60;  // PSN sequence error
inline constexpr uint8_t NAK_INVALID_REQ = 0x61;
inline constexpr uint8_t NAK_REMOTE_ACCESS = 0x62;
inline constexpr uint8_t NAK_REMOTE_OP = 0x63;
inline constexpr uint8_t NAK_INVALID_RD = 0x64;
inline constexpr uint8_t KIND_MASK = 0x60;
inline constexpr uint8_t CREDITS_INVALID = 0x1f;
}  // namespace aeth

// ---- ReduceETH (vendor, 4 bytes): dtype, operator, 2 reserved (zero) ----------------
// dtype and operator use the DMA queue's encodings (desc.h: DType, RedOp).

// ---- a decoded frame ---------------------------------------------------------------

struct Packet {
  // Ethernet / IPv4 / UDP
  uint8_t dst_mac[6] = {};
  uint8_t src_mac[6] = {};
  uint32_t src_ip = 0, dst_ip = 0;  // host byte order
  uint8_t tos = 0;                  // DSCP | ECN
  uint8_t ttl = kDefaultTtl;
  uint16_t ip_id = 0;
  uint16_t udp_src = 0xc000;        // entropy for ECMP (rxe: 0xC000 | hash(qpn))
  // BTH
  uint8_t opcode = 0;
  bool se = false, migreq = false;
  uint8_t pad = 0;                  // parse: PadCnt; build: computed
  uint16_t pkey = kDefaultPKey;
  bool fecn = false, becn = false;
  uint32_t dest_qp = 0;
  bool ack_req = false;
  uint32_t psn = 0;
  // RETH / AtomicETH
  uint64_t va = 0;
  uint32_t rkey = 0;
  uint32_t dma_len = 0;             // RETH
  uint64_t swap_add = 0, compare = 0;  // AtomicETH
  // AETH
  uint8_t syndrome = 0;
  uint32_t msn = 0;
  // AtomicAckETH
  uint64_t orig = 0;
  // ReduceETH
  uint8_t dtype = 0, redop = 0;
  // ImmDt (kept as the 4 wire bytes' big-endian value)
  uint32_t imm = 0;
  // payload (parse: points into the frame; pad bytes excluded)
  const uint8_t* payload = nullptr;
  uint32_t payload_len = 0;
};

// Why a frame was not accepted. The engine counts each (docs/device-abi.md
// §14.5); `not_roce` frames (ARP, other UDP ports) go to
// their own handlers, the rest are dropped silently as the IBA says.
enum class ParseError : uint8_t {
  ok = 0,
  truncated,     // shorter than its headers say
  not_roce,      // not IPv4/UDP to 4791 (the caller looks at the EtherType itself for ARP)
  bad_ip,        // version/IHL, fragment, total length, header checksum
  bad_udp,       // length, nonzero checksum that does not verify
  bad_bth,       // transport version, pad count with no payload, reserved opcode
  bad_length,    // payload shorter than the pad, or present where the opcode has none
  bad_icrc,
  unsupported,   // an opcode this engine does not speak
};
const char* parse_error_name(ParseError e);

// Decodes and checks a whole frame (with its ICRC). On success *out holds
// every field its opcode carries; payload points into `frame`.
ParseError parse(const uint8_t* frame, size_t len, Packet* out);

// Encodes p (its opcode's headers) with `payload` of p.payload_len bytes
// into out: PadCnt, lengths, IPv4 checksum and ICRC computed. Returns the
// frame length, or 0 when the opcode is not spoken, a payload is given to
// an opcode without one, or `cap` is too small.
size_t build(const Packet& p, const uint8_t* payload, uint8_t* out, size_t cap);

// The ICRC of a whole frame (its last 4 bytes are the ICRC field and are
// not covered): CRC-32 over 8 bytes of ones, the IPv4 header with TOS, TTL
// and checksum as ones, the UDP header with its checksum as ones, the BTH
// with byte 4 as ones, the rest up to the ICRC. Frame must be >= 42 + 12 + 4.
uint32_t icrc(const uint8_t* frame, size_t len);

// IPv4 header checksum (RFC 791) of 20 bytes, the checksum field included as is.
uint16_t ipv4_checksum(const uint8_t* ip);

// "aa:bb:cc:dd:ee:ff" / "a.b.c.d" for messages and probe output.
std::string mac_string(const uint8_t* mac);
std::string ip_string(uint32_t ip);

// ---- big-endian field access (the wire's order) -----------------------------------
inline uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
inline uint32_t get24(const uint8_t* p) { return uint32_t{p[0]} << 16 | uint32_t{p[1]} << 8 | p[2]; }
inline uint32_t get32(const uint8_t* p) { return uint32_t{get16(p)} << 16 | get16(p + 2); }
inline uint64_t get64(const uint8_t* p) { return uint64_t{get32(p)} << 32 | get32(p + 4); }
inline void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
inline void put24(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 16);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v);
}
inline void put32(uint8_t* p, uint32_t v) {
  put16(p, static_cast<uint16_t>(v >> 16));
  put16(p + 2, static_cast<uint16_t>(v));
}
inline void put64(uint8_t* p, uint64_t v) {
  put32(p, static_cast<uint32_t>(v >> 32));
  put32(p + 4, static_cast<uint32_t>(v));
}

}  // namespace hcomm::hal::abi::roce
