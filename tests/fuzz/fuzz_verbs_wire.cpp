// The verbs and npu_roce wire-up parsers (api/proto/verbs_wire.h) on the
// same arbitrary blobs, as
// if every other rank of the job contributed them to the allgather. Input:
//   byte 0: nranks - 1 (mod 8); byte 1: this rank (mod nranks; >= 0xf8:
//   out of range, to probe the argument check); then per rank a u16 length
//   (host order) and that many bytes, as far as the input goes (a short input
//   gives fewer blobs than ranks).
// Whatever it accepts must be what connect() relies on: one entry per rank,
// a present rank's blob exactly header + 4 bytes per rank, with a valid MTU,
// and the QPN for this rank read from inside that blob.
#include <cstdlib>
#include <cstring>

#include "api/proto/verbs_wire.h"
#include "tests/fuzz/fuzz.h"

using namespace hcomm::api;

namespace {

std::string frame(int nranks, int me, const std::vector<std::string>& blobs) {
  std::string s;
  s += static_cast<char>(nranks - 1);
  s += static_cast<char>(me);
  for (const std::string& b : blobs) {
    uint16_t n = static_cast<uint16_t>(b.size());
    s.append(reinterpret_cast<const char*>(&n), 2);
    s += b;
  }
  return s;
}

std::string present(int nranks, uint32_t base) {
  VerbsWireHdr h{};
  for (int i = 0; i < 16; ++i) h.gid[i] = static_cast<uint8_t>(base + i);
  h.lid = 3;
  h.mtu = 3;  // IBV_MTU_1024
  h.psn = base * 77;
  h.table_addr = 0x7f0000001000;
  h.locks_addr = 0x7f0000002000;
  h.mailbox_addr = 0x7f0000003000;
  h.table_rkey = base + 1;
  h.locks_rkey = base + 2;
  h.mailbox_rkey = base + 3;
  std::vector<uint32_t> qpns;
  for (int r = 0; r < nranks; ++r) qpns.push_back(base * 100 + static_cast<uint32_t>(r));
  return verbs_wire_blob(h, qpns);
}

std::string roce_present(int nranks, uint32_t base) {
  NpuRoceWireHdr h{};
  h.ip = 0x0a000001u + base;
  for (int i = 0; i < 6; ++i) h.mac[i] = static_cast<uint8_t>(base + i);
  h.mtu = 5;
  h.psn = base * 77;
  h.table_iova = 0x10000;
  h.mailbox_iova = 0x20000;
  h.table_key = 0x101;
  h.mailbox_key = 0x201;
  std::vector<uint32_t> qpns;
  for (int r = 0; r < nranks; ++r) qpns.push_back(r == static_cast<int>(base) ? 0 : 0x100 + static_cast<uint32_t>(r));
  return npu_roce_wire_blob(h, qpns);
}

// What a parser accepted must be what connect() relies on.
template <class Hdr, class Wire>
void check(const std::vector<std::string>& blobs, int nranks, int me, hcomm::Status st, const std::vector<Wire>& ws,
           uint32_t magic, uint16_t version) {
  if (!st) {
    if (st.code() != hcomm::Code::protocol_error || st.message().empty()) std::abort();
    return;
  }
  if (me < 0 || me >= nranks || blobs.size() != static_cast<size_t>(nranks) || ws.size() != blobs.size())
    std::abort();
  for (size_t r = 0; r < ws.size(); ++r) {
    const Wire& w = ws[r];
    const std::string& b = blobs[r];
    if (b.size() < sizeof(Hdr)) std::abort();
    if (!w.present) continue;
    if (w.h.magic != magic || w.h.version != version || w.h.present == 0 ||
        w.h.nqp != static_cast<uint32_t>(nranks) || b.size() != sizeof w.h + 4 * static_cast<size_t>(nranks) ||
        w.h.mtu < kVerbsMtuMin || w.h.mtu > kVerbsMtuMax)
      std::abort();
    uint32_t qpn;
    std::memcpy(&qpn, b.data() + sizeof w.h + 4 * static_cast<size_t>(me), 4);
    if (qpn != w.qpn || std::memcmp(&w.h, b.data(), sizeof w.h) != 0) std::abort();
  }
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  return {
      frame(1, 0, {present(1, 1)}),
      frame(2, 1, {present(2, 1), present(2, 2)}),
      frame(3, 0, {present(3, 1), verbs_wire_absent("no RDMA device"), present(3, 3)}),
      frame(4, 2, {verbs_wire_absent(""), verbs_wire_absent("ibv_open_device: EPERM"), present(4, 3), present(4, 4)}),
      frame(2, 0, {present(3, 1), present(2, 2)}),
      frame(2, 1, {roce_present(2, 0), roce_present(2, 1)}),
      frame(3, 2, {roce_present(3, 0), npu_roce_wire_absent("this rank runs the host engine"), roce_present(3, 2)}),
  };
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int nranks = 1 + data[0] % 8;
  const int me = data[1] >= 0xf8 ? static_cast<int>(data[1]) - 0xfc : data[1] % nranks;
  std::vector<std::string> blobs;
  size_t off = 2;
  while (off + 2 <= size && blobs.size() < 16) {
    uint16_t n;
    std::memcpy(&n, data + off, 2);
    off += 2;
    const size_t take = std::min<size_t>(n, size - off);
    blobs.emplace_back(reinterpret_cast<const char*>(data + off), take);
    off += take;
  }
  std::vector<VerbsPeerWire> ws;
  check<VerbsWireHdr>(blobs, nranks, me, parse_verbs_wire(blobs, nranks, me, &ws), ws, kVerbsWireMagic,
                      kVerbsWireVersion);
  std::vector<NpuRoceWire> rs;
  check<NpuRoceWireHdr>(blobs, nranks, me, parse_npu_roce_wire(blobs, nranks, me, &rs), rs, kNpuRoceWireMagic,
                        kNpuRoceWireVersion);
  return 0;
}
