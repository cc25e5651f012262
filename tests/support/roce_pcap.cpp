// Writes a pcap (Ethernet link type) of RoCEv2 frames built by the NPU
// engine's wire code (hal/abi/roce.h): every opcode it speaks, with payloads
// of several lengths (every pad count), and the AETH syndromes it sends.
// tests/unit/roce_wire_check.py reads the file with tshark and scapy, which
// nobody here wrote, and compares their decoding with the list this program
// prints on stdout: "frame opcode dest_qp psn payload_len" per frame.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "hal/abi/roce.h"

using namespace hcomm::hal::abi::roce;

namespace {

void put_le32(std::FILE* f, uint32_t v) {
  const uint8_t b[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v >> 16),
                        static_cast<uint8_t>(v >> 24)};
  std::fwrite(b, 1, 4, f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.pcap\n", argv[0]);
    return 2;
  }
  std::FILE* f = std::fopen(argv[1], "wb");
  if (f == nullptr) {
    std::perror(argv[1]);
    return 1;
  }
  put_le32(f, 0xa1b2c3d4);  // pcap: magic, version 2.4, zone, sigfigs, snaplen, LINKTYPE_ETHERNET
  put_le32(f, 2 | 4u << 16);
  put_le32(f, 0);
  put_le32(f, 0);
  put_le32(f, 65535);
  put_le32(f, 1);
  std::vector<uint8_t> payload(4096), frame(kMaxFrame);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 13 + 1);
  int n = 0;
  auto emit = [&](Packet p) {
    const size_t len = build(p, payload.data(), frame.data(), frame.size());
    if (len == 0) {
      std::fprintf(stderr, "build refused opcode 0x%02x\n", p.opcode);
      std::exit(1);
    }
    ++n;
    put_le32(f, 1700000000u + static_cast<uint32_t>(n));
    put_le32(f, 0);
    put_le32(f, static_cast<uint32_t>(len));
    put_le32(f, static_cast<uint32_t>(len));
    std::fwrite(frame.data(), 1, len, f);
    std::printf("%d %u %u %u %u\n", n, p.opcode, p.dest_qp, p.psn, p.payload_len);
  };
  uint32_t psn = 0xfffff0;  // crosses the 24-bit wrap
  for (int op = 0; op < 256; ++op) {
    const uint16_t h = op_headers(static_cast<uint8_t>(op));
    if (h == 0) continue;
    const std::vector<uint32_t> lens = (h & hdr::PAYLOAD) ? std::vector<uint32_t>{1, 2, 3, 4, 256, 1024}
                                                          : std::vector<uint32_t>{0};
    for (uint32_t len : lens) {
      Packet p;
      const uint8_t dm[6] = {0x02, 0x4e, 0x50, 0x55, 0x00, 0x02}, sm[6] = {0x02, 0x4e, 0x50, 0x55, 0x00, 0x01};
      std::memcpy(p.dst_mac, dm, 6);
      std::memcpy(p.src_mac, sm, 6);
      p.src_ip = 0x0a000001;
      p.dst_ip = 0x0a000002;
      p.opcode = static_cast<uint8_t>(op);
      p.dest_qp = 0x11 + static_cast<uint32_t>(op);
      p.psn = psn;
      psn = psn_add(psn, 1);
      p.ack_req = (h & hdr::LAST) != 0;
      p.va = 0x100000 + static_cast<uint64_t>(op) * 0x1000;
      p.rkey = 0x00000102;
      p.dma_len = len;
      p.swap_add = 7;
      p.compare = 3;
      p.msn = 5;
      p.orig = 42;
      p.dtype = 10;
      p.redop = 0;
      p.imm = 0x01020304;
      p.payload_len = len;
      emit(p);
    }
  }
  for (int syn : {aeth::ACK | aeth::CREDITS_INVALID, aeth::RNR_NAK | 14, int{aeth::NAK_PSN_SEQ}, int{aeth::NAK_INVALID_REQ},
                  int{aeth::NAK_REMOTE_ACCESS}, int{aeth::NAK_REMOTE_OP}}) {
    Packet p;
    p.opcode = static_cast<uint8_t>(Op::ACKNOWLEDGE);
    p.src_ip = 0x0a000002;
    p.dst_ip = 0x0a000001;
    p.dest_qp = 0x22;
    p.psn = 77;
    p.syndrome = static_cast<uint8_t>(syn);
    p.msn = 9;
    emit(p);
  }
  return std::fclose(f) == 0 ? 0 : 1;
}
