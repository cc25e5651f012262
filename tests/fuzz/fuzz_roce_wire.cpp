// The NPU RoCEv2 engine's frame parser (hal/abi/roce.h) on arbitrary frames,
// as a peer, a switch or a corrupting link could deliver them. Input:
//   byte 0: bit 0 -> fix up the IPv4 header checksum, bit 1 -> fix up the
//   ICRC (so mutations reach the BTH, extension-header and length rules
//   behind the checks a random frame never passes); the rest is the frame.
// Whatever parse() accepts must be what the engine relies on: the payload
// inside the frame, its length consistent with the opcode's headers and
// pad, and the packet rebuilt by build() parsing back to the same fields.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "hal/abi/roce.h"
#include "tests/fuzz/fuzz.h"

using namespace hcomm::hal::abi::roce;

namespace {

std::string with_mode(uint8_t mode, const std::vector<uint8_t>& f) {
  std::string s(1, static_cast<char>(mode));
  s.append(reinterpret_cast<const char*>(f.data()), f.size());
  return s;
}

std::vector<uint8_t> frame(Op op, uint32_t len, uint32_t psn) {
  Packet p;
  p.opcode = static_cast<uint8_t>(op);
  p.src_ip = 0x0a000001;
  p.dst_ip = 0x0a000002;
  p.dest_qp = 0x123;
  p.psn = psn;
  p.va = 0x1000;
  p.rkey = 0x0101;
  p.dma_len = len;
  p.payload_len = len;
  p.dtype = 10;
  std::vector<uint8_t> payload(len, 0xab), out(kMaxFrame);
  out.resize(build(p, payload.data(), out.data(), out.size()));
  return out;
}

bool same(const Packet& a, const Packet& b) {
  return a.opcode == b.opcode && a.se == b.se && a.migreq == b.migreq && a.pad == b.pad && a.pkey == b.pkey &&
         a.dest_qp == b.dest_qp && a.ack_req == b.ack_req && a.psn == b.psn && a.va == b.va && a.rkey == b.rkey &&
         a.dma_len == b.dma_len && a.swap_add == b.swap_add && a.compare == b.compare && a.syndrome == b.syndrome &&
         a.msn == b.msn && a.orig == b.orig && a.dtype == b.dtype && a.redop == b.redop && a.imm == b.imm &&
         a.payload_len == b.payload_len && a.src_ip == b.src_ip && a.dst_ip == b.dst_ip &&
         (a.payload_len == 0 || std::memcmp(a.payload, b.payload, a.payload_len) == 0);
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  std::vector<std::string> s;
  for (int op = 0; op < 256; ++op) {
    const uint16_t h = op_headers(static_cast<uint8_t>(op));
    if (h == 0) continue;
    for (uint32_t len : (h & hdr::PAYLOAD) ? std::vector<uint32_t>{1, 3, 64} : std::vector<uint32_t>{0})
      s.push_back(with_mode(3, frame(static_cast<Op>(op), len, 0xfffffe)));
  }
  s.push_back(with_mode(0, frame(Op::WRITE_ONLY, 8, 0)));  // as sent: checks untouched
  s.push_back(with_mode(1, frame(Op::READ_REQUEST, 0, 5)));
  return s;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  std::vector<uint8_t> f(data + 1, data + size);
  const size_t ip = kEthLen;
  if ((mode & 1) && f.size() >= ip + kIpv4Len) {
    put16(&f[ip + 10], 0);
    put16(&f[ip + 10], ipv4_checksum(&f[ip]));
  }
  if ((mode & 2) && f.size() >= ip + kIpv4Len) {
    const size_t flen = ip + get16(&f[ip + 2]);  // the IP datagram's end, as parse() takes it
    if (flen <= f.size() && flen >= kL2L4Len + kBthLen + kIcrcLen) {
      const uint32_t c = icrc(f.data(), flen);
      for (size_t k = 0; k < 4; ++k) f[flen - 4 + k] = static_cast<uint8_t>(c >> (8 * k));
    }
  }
  Packet p;
  const ParseError e = parse(f.data(), f.size(), &p);
  if (parse_error_name(e)[0] == '?') std::abort();
  if (e != ParseError::ok) return 0;
  const uint16_t h = op_headers(p.opcode);
  if (h == 0) std::abort();
  const size_t flen = kEthLen + get16(&f[kEthLen + 2]);
  if (flen > f.size()) std::abort();
  if (h & hdr::PAYLOAD) {
    if (p.payload < f.data() + kL2L4Len + kBthLen + ext_len(h) ||
        p.payload + p.payload_len + p.pad + kIcrcLen != f.data() + flen)
      std::abort();
  } else if (p.payload_len != 0 || p.pad != 0) {
    std::abort();
  }
  if (p.pad > 3) std::abort();
  std::vector<uint8_t> again(kMaxFrame + 64);
  const size_t n = build(p, p.payload, again.data(), again.size());
  // Only a frame longer than the engine's largest (a payload past 4096 bytes) may not rebuild.
  if (n == 0) {
    if (p.payload_len <= 4096) std::abort();
    return 0;
  }
  Packet q;
  if (parse(again.data(), n, &q) != ParseError::ok || !same(p, q)) std::abort();
  return 0;
}
