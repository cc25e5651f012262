// The NPU RoCEv2 engine's wire format (hal/abi/roce.h, docs/device-abi.md
// §12): every opcode the engine speaks round-trips through build() and
// parse() field for field; the ICRC matches a value computed by hand from
// the IBA's masking rule and a bitwise CRC-32 written here (not zlib); one
// flipped bit anywhere the ICRC covers is refused, while the fields it masks
// may change in flight; every truncation and malformed length is refused
// with its reason; PSN arithmetic wraps at 2^24.
// (tests/unit/roce_wire_check.py checks the same frames with tshark's
// InfiniBand dissector and scapy's ICRC, implementations nobody here wrote.)
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "hal/abi/roce.h"

namespace hcomm::hal::abi::roce {
namespace {

// Bitwise reflected CRC-32 (poly 0xEDB88320), init ~0, final ~0: the CRC the
// IBA's ICRC is (§7.8.1), written out slowly so it shares nothing with zlib.
constexpr size_t kExt = kL2L4Len + kBthLen;  // where the extension headers start

uint32_t crc32_slow(const std::vector<uint8_t>& d) {
  uint32_t c = 0xffffffffu;
  for (uint8_t b : d) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
  }
  return ~c;
}

// The ICRC by the spec's recipe, on a copy: 8 bytes of ones (the LRH a RoCE
// frame lacks), then IP..BTH with TOS, TTL, IP checksum, UDP checksum and
// BTH byte 4 set to ones, then the rest up to the ICRC field.
uint32_t icrc_by_hand(const uint8_t* f, size_t len) {
  std::vector<uint8_t> d(8, 0xff);
  d.insert(d.end(), f + kEthLen, f + len - kIcrcLen);
  uint8_t* ip = d.data() + 8;
  ip[1] = 0xff;                                   // TOS
  ip[8] = 0xff;                                   // TTL
  ip[10] = ip[11] = 0xff;                         // header checksum
  ip[kIpv4Len + 6] = ip[kIpv4Len + 7] = 0xff;     // UDP checksum
  ip[kIpv4Len + kUdpLen + bth::kMaskedByte] = 0xff;  // FECN, BECN, resv6
  return crc32_slow(d);
}

uint32_t icrc_field(const uint8_t* f, size_t len) {
  const uint8_t* c = f + len - kIcrcLen;
  return uint32_t{c[0]} | uint32_t{c[1]} << 8 | uint32_t{c[2]} << 16 | uint32_t{c[3]} << 24;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

// A packet with every field set to something distinctive; build() writes
// only those its opcode carries.
Packet sample(uint8_t opcode, uint32_t payload_len) {
  Packet p;
  const uint8_t dm[6] = {0x02, 0x4e, 0x50, 0x55, 0x00, 0x01}, sm[6] = {0x02, 0x4e, 0x50, 0x55, 0x01, 0x02};
  std::memcpy(p.dst_mac, dm, 6);
  std::memcpy(p.src_mac, sm, 6);
  p.src_ip = 0x0a000102;
  p.dst_ip = 0x0a000201;
  p.tos = 0x02;  // ECT(0)
  p.ttl = 64;
  p.ip_id = 0x1234;
  p.udp_src = 0xc0de;
  p.opcode = opcode;
  p.se = opcode == static_cast<uint8_t>(Op::SEND_ONLY);
  p.pkey = kDefaultPKey;
  p.dest_qp = 0x000abc;
  p.ack_req = true;
  p.psn = 0xfffffe;
  p.va = 0x0000100000002000ull;
  p.rkey = 0x00010203;
  p.dma_len = 8192;
  p.swap_add = 0x1122334455667788ull;
  p.compare = 0x99aabbccddeeff00ull;
  p.syndrome = aeth::ACK | 0x1f;
  p.msn = 0x00beef;
  p.orig = 0x0102030405060708ull;
  p.dtype = 10;  // FP32
  p.redop = 2;   // MAX
  p.imm = 0xcafef00d;
  p.payload_len = payload_len;
  return p;
}

std::vector<uint8_t> make(const Packet& p, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> f(kMaxFrame + 64);
  const size_t n = build(p, payload.empty() ? nullptr : payload.data(), f.data(), f.size());
  f.resize(n);
  return f;
}

std::vector<uint8_t> spoken_opcodes() {
  std::vector<uint8_t> ops;
  for (int o = 0; o < 256; ++o)
    if (op_headers(static_cast<uint8_t>(o)) != 0) ops.push_back(static_cast<uint8_t>(o));
  return ops;
}

TEST(RoceWire, SpeaksTheRcSetAndTheVendorReduce) {
  const std::vector<uint8_t> ops = spoken_opcodes();
  std::vector<uint8_t> want;
  for (uint8_t o = 0x00; o <= 0x14; ++o) want.push_back(o);
  for (uint8_t o = 0xc0; o <= 0xc3; ++o) want.push_back(o);
  EXPECT_EQ(ops, want);
  // Extension header lengths (IBA Table 38 + §12's ReduceETH).
  EXPECT_EQ(ext_len(op_headers(0x04)), 0u);                      // SEND_ONLY
  EXPECT_EQ(ext_len(op_headers(0x05)), kImmLen);                 // SEND_ONLY_IMM
  EXPECT_EQ(ext_len(op_headers(0x0a)), kRethLen);                // WRITE_ONLY
  EXPECT_EQ(ext_len(op_headers(0x0b)), kRethLen + kImmLen);      // WRITE_ONLY_IMM
  EXPECT_EQ(ext_len(op_headers(0x09)), kImmLen);                 // WRITE_LAST_IMM
  EXPECT_EQ(ext_len(op_headers(0x0c)), kRethLen);                // READ_REQUEST
  EXPECT_EQ(ext_len(op_headers(0x0d)), kAethLen);                // READ_RESPONSE_FIRST
  EXPECT_EQ(ext_len(op_headers(0x0e)), 0u);                      // READ_RESPONSE_MIDDLE
  EXPECT_EQ(ext_len(op_headers(0x11)), kAethLen);                // ACKNOWLEDGE
  EXPECT_EQ(ext_len(op_headers(0x12)), kAethLen + kAtomicAckLen);  // ATOMIC_ACKNOWLEDGE
  EXPECT_EQ(ext_len(op_headers(0x13)), kAtomicEthLen);           // COMPARE_SWAP
  EXPECT_EQ(ext_len(op_headers(0x14)), kAtomicEthLen);           // FETCH_ADD
  EXPECT_EQ(ext_len(op_headers(0xc0)), kRethLen + kReduceEthLen);  // WRITE_REDUCE_FIRST
  EXPECT_EQ(ext_len(op_headers(0xc1)), 0u);
  EXPECT_EQ(ext_len(op_headers(0xc3)), kRethLen + kReduceEthLen);  // WRITE_REDUCE_ONLY
  EXPECT_STREQ(op_name(0x0a), "RDMA_WRITE_ONLY");
  EXPECT_STREQ(op_name(0xc3), "WRITE_REDUCE_ONLY");
}

TEST(RoceWire, EveryOpcodeRoundTripsFieldForField) {
  for (uint8_t op : spoken_opcodes()) {
    const uint16_t h = op_headers(op);
    const std::vector<uint32_t> lens = (h & hdr::PAYLOAD) ? std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 4096}
                                                          : std::vector<uint32_t>{0};
    for (uint32_t n : lens) {
      SCOPED_TRACE(std::string(op_name(op)) + " payload " + std::to_string(n));
      const Packet in = sample(op, n);
      const std::vector<uint8_t> payload = pattern(n, op);
      const std::vector<uint8_t> f = make(in, payload);
      ASSERT_FALSE(f.empty());
      const size_t pad = (4 - n % 4) % 4;
      EXPECT_EQ(f.size(), kL2L4Len + kBthLen + ext_len(h) + n + pad + kIcrcLen);
      EXPECT_EQ(f.size() % 2, 0u);  // everything after the 42-byte L2-L4 headers is a multiple of 4
      EXPECT_EQ(icrc_field(f.data(), f.size()), icrc_by_hand(f.data(), f.size()));
      EXPECT_EQ(ipv4_checksum(f.data() + kEthLen), 0);  // a correct header sums to zero
      Packet out;
      ASSERT_EQ(parse(f.data(), f.size(), &out), ParseError::ok);
      EXPECT_EQ(out.opcode, op);
      EXPECT_EQ(std::memcmp(out.dst_mac, in.dst_mac, 6), 0);
      EXPECT_EQ(std::memcmp(out.src_mac, in.src_mac, 6), 0);
      EXPECT_EQ(out.src_ip, in.src_ip);
      EXPECT_EQ(out.dst_ip, in.dst_ip);
      EXPECT_EQ(out.tos, in.tos);
      EXPECT_EQ(out.ttl, in.ttl);
      EXPECT_EQ(out.ip_id, in.ip_id);
      EXPECT_EQ(out.udp_src, in.udp_src);
      EXPECT_EQ(out.se, in.se);
      EXPECT_EQ(out.pad, pad);
      EXPECT_EQ(out.pkey, in.pkey);
      EXPECT_EQ(out.dest_qp, in.dest_qp);
      EXPECT_EQ(out.ack_req, in.ack_req);
      EXPECT_EQ(out.psn, in.psn);
      if (h & (hdr::RETH | hdr::ATOMIC_ETH)) {
        EXPECT_EQ(out.va, in.va);
        EXPECT_EQ(out.rkey, in.rkey);
      } else {
        EXPECT_EQ(out.va, 0u);
        EXPECT_EQ(out.rkey, 0u);
      }
      EXPECT_EQ(out.dma_len, (h & hdr::RETH) ? in.dma_len : 0u);
      EXPECT_EQ(out.swap_add, (h & hdr::ATOMIC_ETH) ? in.swap_add : 0u);
      EXPECT_EQ(out.compare, (h & hdr::ATOMIC_ETH) ? in.compare : 0u);
      EXPECT_EQ(out.syndrome, (h & hdr::AETH) ? in.syndrome : 0u);
      EXPECT_EQ(out.msn, (h & hdr::AETH) ? in.msn : 0u);
      EXPECT_EQ(out.orig, (h & hdr::ATOMIC_ACK) ? in.orig : 0u);
      EXPECT_EQ(out.dtype, (h & hdr::REDUCE_ETH) ? in.dtype : 0u);
      EXPECT_EQ(out.redop, (h & hdr::REDUCE_ETH) ? in.redop : 0u);
      EXPECT_EQ(out.imm, (h & hdr::IMM) ? in.imm : 0u);
      ASSERT_EQ(out.payload_len, n);
      if (n > 0) {
        EXPECT_EQ(std::memcmp(out.payload, payload.data(), n), 0);
      }
    }
  }
}

// Byte offsets inside the frame that are laid out by the spec, checked
// against the bytes build() wrote: a FETCH_ADD and a WRITE_ONLY.
TEST(RoceWire, HeadersSitWhereTheSpecPutsThem) {
  Packet p = sample(static_cast<uint8_t>(Op::FETCH_ADD), 0);
  std::vector<uint8_t> f = make(p, {});
  ASSERT_EQ(f.size(), 42u + 12 + 28 + 4);
  EXPECT_EQ(f[12], 0x08);
  EXPECT_EQ(f[13], 0x00);  // EtherType IPv4
  EXPECT_EQ(f[14], 0x45);  // version 4, IHL 5
  EXPECT_EQ(f[14 + 9], 17);  // UDP
  EXPECT_EQ(get16(&f[34 + 2]), 4791);  // UDP destination port
  EXPECT_EQ(get16(&f[34 + 4]), 8 + 12 + 28 + 4);  // UDP length
  EXPECT_EQ(get16(&f[34 + 6]), 0);  // no UDP checksum
  EXPECT_EQ(f[42], 0x14);  // BTH opcode
  EXPECT_EQ(f[43] & 0x0f, 0);  // TVer 0
  EXPECT_EQ(get16(&f[44]), 0xffff);  // P_Key
  EXPECT_EQ(get24(&f[47]), 0xabcu);  // DestQP
  EXPECT_EQ(f[50], 0x80);  // AckReq
  EXPECT_EQ(get24(&f[51]), 0xfffffeu);  // PSN
  EXPECT_EQ(get64(&f[54]), p.va);  // AtomicETH: VA, R_Key, swap/add, compare
  EXPECT_EQ(get32(&f[62]), p.rkey);
  EXPECT_EQ(get64(&f[66]), p.swap_add);
  EXPECT_EQ(get64(&f[74]), p.compare);

  p = sample(static_cast<uint8_t>(Op::WRITE_ONLY), 5);
  f = make(p, pattern(5, 1));
  EXPECT_EQ((f[43] >> 4) & 3, 3);  // PadCnt: 5 bytes padded to 8
  EXPECT_EQ(get32(&f[54 + 8]), p.rkey);
  EXPECT_EQ(get32(&f[54 + 12]), p.dma_len);
  EXPECT_EQ(f[54 + 16 + 5], 0);  // pad bytes are zero
  EXPECT_EQ(f[54 + 16 + 7], 0);
}

// One flipped bit in any byte the ICRC covers is refused (the IPv4 header's
// own checksum may refuse it first); bits in the masked fields (TOS, TTL,
// the IPv4 checksum after a legitimate rewrite, the UDP checksum, BTH byte 4)
// leave the ICRC valid, as routers and ECN marking change them in flight.
TEST(RoceWire, OneFlippedBitIsRefused) {
  for (uint8_t op : {static_cast<uint8_t>(Op::WRITE_ONLY), static_cast<uint8_t>(Op::COMPARE_SWAP),
                     static_cast<uint8_t>(Op::ACKNOWLEDGE), static_cast<uint8_t>(Op::WRITE_REDUCE_FIRST)}) {
    const Packet in = sample(op, (op_headers(op) & hdr::PAYLOAD) ? 37 : 0);
    const std::vector<uint8_t> f = make(in, pattern(in.payload_len, 3));
    Packet out;
    ASSERT_EQ(parse(f.data(), f.size(), &out), ParseError::ok);
    for (size_t i = kEthLen; i < f.size(); ++i) {
      for (int bit = 0; bit < 8; ++bit) {
        std::vector<uint8_t> g = f;
        g[i] ^= static_cast<uint8_t>(1u << bit);
        const ParseError e = parse(g.data(), g.size(), &out);
        const bool masked = i == kEthLen + 1 || i == kEthLen + 8 || i == kEthLen + 10 || i == kEthLen + 11 ||
                            i == kL2L4Len - 2 || i == kL2L4Len - 1 || i == kL2L4Len + bth::kMaskedByte;
        if (i >= kL2L4Len) {
          // Nothing but the ICRC checks the transport headers and payload:
          // every flip is a bad ICRC (or, on BTH byte 4, no error at all).
          EXPECT_EQ(e, i == kL2L4Len + bth::kMaskedByte ? ParseError::ok : ParseError::bad_icrc)
              << op_name(op) << " byte " << i << " bit " << bit;
        } else if (!masked || i == kEthLen + 10 || i == kEthLen + 11) {
          EXPECT_NE(e, ParseError::ok) << op_name(op) << " byte " << i << " bit " << bit;
        }
      }
    }
    // TOS and TTL rewritten with the IPv4 checksum fixed up: still valid.
    std::vector<uint8_t> g = f;
    g[kEthLen + 1] = 0x03;  // ECN: congestion experienced
    g[kEthLen + 8] = 17;
    put16(&g[kEthLen + 10], 0);
    put16(&g[kEthLen + 10], ipv4_checksum(&g[kEthLen]));
    ASSERT_EQ(parse(g.data(), g.size(), &out), ParseError::ok) << op_name(op);
    EXPECT_EQ(out.tos, 0x03);
    EXPECT_EQ(out.ttl, 17);
    // FECN/BECN set in flight: still valid, and reported.
    g = f;
    g[kL2L4Len + bth::kMaskedByte] |= bth::FECN | bth::BECN;
    ASSERT_EQ(parse(g.data(), g.size(), &out), ParseError::ok);
    EXPECT_TRUE(out.fecn);
    EXPECT_TRUE(out.becn);
  }
}

// Every prefix of a valid frame is refused (nothing is read past its end:
// the copy is exactly as long as the prefix, so ASan sees any overread).
TEST(RoceWire, EveryTruncationIsRefused) {
  for (uint8_t op : spoken_opcodes()) {
    const Packet in = sample(op, (op_headers(op) & hdr::PAYLOAD) ? 13 : 0);
    const std::vector<uint8_t> f = make(in, pattern(in.payload_len, 9));
    for (size_t n = 0; n < f.size(); ++n) {
      std::vector<uint8_t> g(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(n));
      Packet out;
      const ParseError e = parse(g.data(), g.size(), &out);
      EXPECT_NE(e, ParseError::ok) << op_name(op) << " cut to " << n;
      if (n >= kEthLen) {
        EXPECT_EQ(e, ParseError::truncated) << op_name(op) << " cut to " << n;
      }
    }
  }
}

// Rewrites a frame's lengths as a sender that lied would, with the IPv4
// checksum and ICRC recomputed, so the length rule is what refuses it.
std::vector<uint8_t> relength(std::vector<uint8_t> f, size_t keep_bytes, int pad_override = -1) {
  f.resize(keep_bytes + kIcrcLen);
  uint8_t* ip = f.data() + kEthLen;
  put16(ip + 2, static_cast<uint16_t>(f.size() - kEthLen));
  put16(ip + 10, 0);
  put16(ip + 10, ipv4_checksum(ip));
  put16(ip + kIpv4Len + 4, static_cast<uint16_t>(f.size() - kEthLen - kIpv4Len));
  if (pad_override >= 0)
    f[kL2L4Len + 1] = static_cast<uint8_t>((f[kL2L4Len + 1] & ~bth::PAD_MASK) | pad_override << bth::PAD_SHIFT);
  const uint32_t c = icrc(f.data(), f.size());
  for (int k = 0; k < 4; ++k) f[f.size() - kIcrcLen + static_cast<size_t>(k)] = static_cast<uint8_t>(c >> (8 * k));
  return f;
}

TEST(RoceWire, MalformedFramesAreRefusedWithTheirReason) {
  Packet out;
  const Packet w = sample(static_cast<uint8_t>(Op::WRITE_ONLY), 8);
  const std::vector<uint8_t> wf = make(w, pattern(8, 5));
  const size_t wbody = wf.size() - kIcrcLen;  // bytes before the ICRC
  {  // payload not a multiple of 4 on the wire
    std::vector<uint8_t> g = relength(wf, wbody - 1);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_length);
    g = relength(wf, wbody - 4);  // 4 bytes shorter: still a multiple of 4, fine
    ASSERT_EQ(parse(g.data(), g.size(), &out), ParseError::ok);
    EXPECT_EQ(out.payload_len, 4u);
    g = relength(wf, kExt + kRethLen, 3);  // a pad count with no payload under it
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_length);
    g = relength(wf, kExt + 8, 0);  // shorter than the RETH it must carry
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::truncated);
  }
  {  // a payload on an opcode that has none (an ACK with 4 extra bytes)
    const std::vector<uint8_t> af = make(sample(static_cast<uint8_t>(Op::ACKNOWLEDGE), 0), {});
    std::vector<uint8_t> g = af;
    g.insert(g.end() - kIcrcLen, {1, 2, 3, 4});
    g = relength(g, g.size() - kIcrcLen);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_length);
    g = relength(af, af.size() - kIcrcLen, 2);  // a pad count on it
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_length);
  }
  {  // BTH transport version other than 0
    std::vector<uint8_t> g = wf;
    g[kL2L4Len + 1] |= 1;
    g = relength(g, g.size() - kIcrcLen);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_bth);
  }
  {  // ReduceETH reserved bytes not zero
    std::vector<uint8_t> g = make(sample(static_cast<uint8_t>(Op::WRITE_REDUCE_ONLY), 8), pattern(8, 1));
    g[kExt + kRethLen + 3] = 1;
    g = relength(g, g.size() - kIcrcLen);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_bth);
  }
  // Opcodes the engine does not speak: UC SEND_FIRST (0x20), UD SEND_ONLY
  // (0x64), SEND_LAST_INV (0x16), the rest of the vendor range, reserved ones.
  for (uint8_t op : {0x15, 0x16, 0x17, 0x20, 0x64, 0xc4, 0xff}) {
    std::vector<uint8_t> g = wf;
    g[kL2L4Len] = op;
    g = relength(g, g.size() - kIcrcLen);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::unsupported) << int{op};
  }
  {  // not RoCE: ARP, another UDP port, TCP
    std::vector<uint8_t> g = wf;
    put16(&g[12], kEtherArp);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::not_roce);
    g = wf;
    put16(&g[kEthLen + kIpv4Len + 2], 4792);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::not_roce);
    g = wf;
    g[kEthLen + 9] = 6;
    put16(&g[kEthLen + 10], 0);
    put16(&g[kEthLen + 10], ipv4_checksum(&g[kEthLen]));
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::not_roce);
  }
  {  // IPv4 with options, a fragment, a UDP length that disagrees with IP's
    std::vector<uint8_t> g = wf;
    g[kEthLen] = 0x46;
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_ip);
    g = wf;
    put16(&g[kEthLen + 6], 0x2000);  // MF
    put16(&g[kEthLen + 10], 0);
    put16(&g[kEthLen + 10], ipv4_checksum(&g[kEthLen]));
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_ip);
    g = wf;
    put16(&g[kEthLen + kIpv4Len + 4], static_cast<uint16_t>(get16(&g[kEthLen + kIpv4Len + 4]) - 4));
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::bad_udp);
  }
  {  // an Ethernet pad after the IP datagram (a short frame padded to 60) is ignored
    const std::vector<uint8_t> af = make(sample(static_cast<uint8_t>(Op::ACKNOWLEDGE), 0), {});
    ASSERT_LT(af.size(), 64u);
    std::vector<uint8_t> g = af;
    g.resize(64, 0);
    EXPECT_EQ(parse(g.data(), g.size(), &out), ParseError::ok);
  }
  // build() refuses what it cannot encode.
  std::vector<uint8_t> buf(kMaxFrame);
  Packet bad = sample(static_cast<uint8_t>(Op::ACKNOWLEDGE), 4);
  EXPECT_EQ(build(bad, buf.data(), buf.data(), buf.size()), 0u);  // payload on an ACK
  bad = sample(0x20, 0);
  EXPECT_EQ(build(bad, nullptr, buf.data(), buf.size()), 0u);  // unspoken opcode
  bad = sample(static_cast<uint8_t>(Op::WRITE_ONLY), 4096);
  EXPECT_EQ(build(bad, buf.data(), buf.data(), 100), 0u);  // no room
  EXPECT_EQ(build(bad, nullptr, buf.data(), buf.size()), 0u);  // no payload given
}

TEST(RoceWire, PsnArithmeticWrapsAt24Bits) {
  EXPECT_EQ(psn_add(0xffffff, 1), 0u);
  EXPECT_EQ(psn_add(0xfffff0, 0x20), 0x10u);
  EXPECT_EQ(psn_diff(0x10, 0xfffff0), 0x20);
  EXPECT_EQ(psn_diff(0xfffff0, 0x10), -0x20);
  EXPECT_EQ(psn_diff(5, 5), 0);
  EXPECT_EQ(psn_diff(0x7fffff, 0), 0x7fffff);
  EXPECT_EQ(psn_diff(0x800000, 0), -0x800000);  // half the space: counted as behind
  // A PSN that wrapped in the header stays 24 bits on the wire.
  Packet p = sample(static_cast<uint8_t>(Op::SEND_ONLY), 4);
  p.psn = psn_add(0xffffff, 2);
  const std::vector<uint8_t> f = make(p, pattern(4, 0));
  Packet out;
  ASSERT_EQ(parse(f.data(), f.size(), &out), ParseError::ok);
  EXPECT_EQ(out.psn, 1u);
}

TEST(RoceWire, AddressesPrintAsOperatorsWriteThem) {
  const uint8_t m[6] = {0x02, 0x00, 0x0a, 0xff, 0x10, 0x01};
  EXPECT_EQ(mac_string(m), "02:00:0a:ff:10:01");
  EXPECT_EQ(ip_string(0x0a000102), "10.0.1.2");
  EXPECT_STREQ(parse_error_name(ParseError::bad_icrc), "bad ICRC");
}

}  // namespace
}  // namespace hcomm::hal::abi::roce
