#include "api/proto/verbs_wire.h"

#include <cstring>

namespace hcomm::api {

std::string verbs_wire_blob(VerbsWireHdr h, const std::vector<uint32_t>& qpns) {
  h.magic = kVerbsWireMagic;
  h.version = kVerbsWireVersion;
  h.present = 1;
  h.nqp = static_cast<uint32_t>(qpns.size());
  std::string b(reinterpret_cast<const char*>(&h), sizeof h);
  b.append(reinterpret_cast<const char*>(qpns.data()), 4 * qpns.size());
  return b;
}

std::string verbs_wire_absent(const std::string& why) {
  VerbsWireHdr h{};
  h.magic = kVerbsWireMagic;
  h.version = kVerbsWireVersion;
  std::string b(reinterpret_cast<const char*>(&h), sizeof h);
  return b + why.substr(0, kVerbsWhyMax);
}

Status parse_verbs_wire(const std::vector<std::string>& blobs, int nranks, int my_rank,
                        std::vector<VerbsPeerWire>* out) {
  if (nranks < 1 || my_rank < 0 || my_rank >= nranks || blobs.size() != static_cast<size_t>(nranks))
    return Status::error(Code::protocol_error, "verbs wire-up: %zu blobs for rank %d of %d", blobs.size(), my_rank,
                         nranks);
  const size_t n = static_cast<size_t>(nranks);
  out->assign(n, VerbsPeerWire{});
  for (size_t r = 0; r < n; ++r) {
    const std::string& b = blobs[r];
    VerbsPeerWire& w = (*out)[r];
    if (b.size() < sizeof w.h)
      return Status::error(Code::protocol_error, "verbs wire-up from rank %zu: %zu bytes", r, b.size());
    std::memcpy(&w.h, b.data(), sizeof w.h);
    const VerbsWireHdr& h = w.h;
    if (h.magic != kVerbsWireMagic || h.version != kVerbsWireVersion)
      return Status::error(Code::protocol_error, "verbs wire-up from rank %zu: magic %#x version %u (this build: %u)",
                           r, h.magic, h.version, kVerbsWireVersion);
    if (h.present == 0) {  // the rest is that rank's reason, text nobody parses
      w.h = VerbsWireHdr{};
      continue;
    }
    // Compared in 64 bits: 4 * nqp must not wrap.
    if (h.nqp != n || uint64_t{b.size()} != sizeof h + uint64_t{4} * h.nqp)
      return Status::error(Code::protocol_error, "verbs wire-up from rank %zu: %u queue pairs in %zu bytes for %d ranks",
                           r, h.nqp, b.size(), nranks);
    if (h.mtu < kVerbsMtuMin || h.mtu > kVerbsMtuMax)
      return Status::error(Code::protocol_error, "verbs wire-up from rank %zu: MTU code %u", r, h.mtu);
    w.present = true;
    std::memcpy(&w.qpn, b.data() + sizeof h + 4 * static_cast<size_t>(my_rank), 4);
  }
  return Status::ok();
}

}  // namespace hcomm::api
