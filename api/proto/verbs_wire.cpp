#include "api/proto/verbs_wire.h"

#include <cstring>

namespace hcomm::api {

namespace {

// Both messages: header, then nqp QPNs or a reason.
template <class Hdr, class Wire>
Status parse_wire(const char* what, uint32_t magic, uint16_t version, const std::vector<std::string>& blobs,
                  int nranks, int my_rank, std::vector<Wire>* out) {
  if (nranks < 1 || my_rank < 0 || my_rank >= nranks || blobs.size() != static_cast<size_t>(nranks))
    return Status::error(Code::protocol_error, "%s wire-up: %zu blobs for rank %d of %d", what, blobs.size(), my_rank,
                         nranks);
  const size_t n = static_cast<size_t>(nranks);
  out->assign(n, Wire{});
  for (size_t r = 0; r < n; ++r) {
    const std::string& b = blobs[r];
    Wire& w = (*out)[r];
    if (b.size() < sizeof w.h)
      return Status::error(Code::protocol_error, "%s wire-up from rank %zu: %zu bytes", what, r, b.size());
    std::memcpy(&w.h, b.data(), sizeof w.h);
    const Hdr& h = w.h;
    if (h.magic != magic || h.version != version)
      return Status::error(Code::protocol_error, "%s wire-up from rank %zu: magic %#x version %u (this build: %u)",
                           what, r, h.magic, h.version, version);
    if (h.present == 0) {  // the rest is that rank's reason, text nobody parses
      w.h = Hdr{};
      continue;
    }
    // Compared in 64 bits: 4 * nqp must not wrap.
    if (h.nqp != n || uint64_t{b.size()} != sizeof h + uint64_t{4} * h.nqp)
      return Status::error(Code::protocol_error, "%s wire-up from rank %zu: %u queue pairs in %zu bytes for %d ranks",
                           what, r, h.nqp, b.size(), nranks);
    if (h.mtu < kVerbsMtuMin || h.mtu > kVerbsMtuMax)
      return Status::error(Code::protocol_error, "%s wire-up from rank %zu: MTU code %u", what, r, h.mtu);
    w.present = true;
    std::memcpy(&w.qpn, b.data() + sizeof h + 4 * static_cast<size_t>(my_rank), 4);
  }
  return Status::ok();
}

template <class Hdr>
std::string blob(Hdr h, uint32_t magic, uint16_t version, const std::vector<uint32_t>& qpns) {
  h.magic = magic;
  h.version = version;
  h.present = 1;
  h.nqp = static_cast<uint32_t>(qpns.size());
  std::string b(reinterpret_cast<const char*>(&h), sizeof h);
  b.append(reinterpret_cast<const char*>(qpns.data()), 4 * qpns.size());
  return b;
}

template <class Hdr>
std::string absent(uint32_t magic, uint16_t version, const std::string& why) {
  Hdr h{};
  h.magic = magic;
  h.version = version;
  std::string b(reinterpret_cast<const char*>(&h), sizeof h);
  return b + why.substr(0, kVerbsWhyMax);
}

}  // namespace

std::string verbs_wire_blob(VerbsWireHdr h, const std::vector<uint32_t>& qpns) {
  return blob(h, kVerbsWireMagic, kVerbsWireVersion, qpns);
}

std::string verbs_wire_absent(const std::string& why) {
  return absent<VerbsWireHdr>(kVerbsWireMagic, kVerbsWireVersion, why);
}

Status parse_verbs_wire(const std::vector<std::string>& blobs, int nranks, int my_rank,
                        std::vector<VerbsPeerWire>* out) {
  return parse_wire<VerbsWireHdr>("verbs", kVerbsWireMagic, kVerbsWireVersion, blobs, nranks, my_rank, out);
}

std::string npu_roce_wire_blob(NpuRoceWireHdr h, const std::vector<uint32_t>& qpns) {
  return blob(h, kNpuRoceWireMagic, kNpuRoceWireVersion, qpns);
}

std::string npu_roce_wire_absent(const std::string& why) {
  return absent<NpuRoceWireHdr>(kNpuRoceWireMagic, kNpuRoceWireVersion, why);
}

Status parse_npu_roce_wire(const std::vector<std::string>& blobs, int nranks, int my_rank,
                           std::vector<NpuRoceWire>* out) {
  return parse_wire<NpuRoceWireHdr>("npu_roce", kNpuRoceWireMagic, kNpuRoceWireVersion, blobs, nranks, my_rank, out);
}

Status parse_verbs_key_section(const uint8_t* sec, size_t len, bool device_memory, uint32_t* rkey) {
  if (len != 4) return Status::error(Code::protocol_error, "rkey_import: verbs section of %zu bytes", len);
  if (device_memory) return Status::error(Code::protocol_error, "rkey_import: verbs section on device memory");
  std::memcpy(rkey, sec, 4);
  return Status::ok();
}

Status parse_npu_roce_key_section(const uint8_t* sec, size_t len, uint32_t* key, uint64_t* iova) {
  if (len != 12) return Status::error(Code::protocol_error, "rkey_import: npu_roce section of %zu bytes", len);
  std::memcpy(key, sec, 4);
  std::memcpy(iova, sec + 4, 8);
  return Status::ok();
}

Status check_reg_entry(const RegClaim& k, const RegTableEntry& e) {
  if (e.gen != k.gen || (e.gen & 1u) == 0)
    return Status::error(Code::access_denied, "rkey_import: key of rank %d is revoked or stale (slot %u)", k.peer,
                         k.slot);
  if (e.addr != k.addr || e.size != k.size || (k.rights & ~e.rights) != 0 || e.key != k.key)
    return Status::error(Code::access_denied, "rkey_import: key does not match rank %d's registration (forged?)",
                         k.peer);
  return Status::ok();
}

}  // namespace hcomm::api
