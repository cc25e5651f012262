// The verbs and npu_roce sections of a packed remote key, and the check of a
// key against the owner's registration-table entry (api/proto/verbs_wire.h):
// what a peer controls at import is the key (header fields and section), and
// the table entry it lets us read. Input:
//   byte 0: bit 0 = npu_roce (else verbs), bit 1 = the key says device memory
//   bytes 1..28: the key's generation, address, size (u64 each), rights (u32)
//   bytes 29..60: the owner's table entry (RegTableEntry, as read)
//   the rest: the transport's section
// Accepted must mean: the section has its transport's size (verbs: none on
// device memory), and the entry is live, of the key's generation, with the
// key's address (npu_roce: the section's IOVA), size and key, and rights that
// include the key's. Refusals carry the right code and a message.
#include <cstdlib>
#include <cstring>

#include "api/proto/verbs_wire.h"
#include "tests/fuzz/fuzz.h"

using namespace hcomm::api;

namespace {

constexpr size_t kFixed = 1 + 28 + sizeof(RegTableEntry);

std::string input(bool roce, bool device, uint64_t gen, uint64_t addr, uint64_t size, uint32_t rights,
                  const RegTableEntry& e, const std::string& section) {
  std::string s(1, static_cast<char>((roce ? 1 : 0) | (device ? 2 : 0)));
  s.append(reinterpret_cast<const char*>(&gen), 8);
  s.append(reinterpret_cast<const char*>(&addr), 8);
  s.append(reinterpret_cast<const char*>(&size), 8);
  s.append(reinterpret_cast<const char*>(&rights), 4);
  s.append(reinterpret_cast<const char*>(&e), sizeof e);
  return s + section;
}

std::string verbs_section(uint32_t rkey) { return std::string(reinterpret_cast<const char*>(&rkey), 4); }
std::string roce_section(uint32_t key, uint64_t iova) {
  return std::string(reinterpret_cast<const char*>(&key), 4) + std::string(reinterpret_cast<const char*>(&iova), 8);
}

void refused(const hcomm::Status& st, hcomm::Code code) {
  if (st || st.code() != code || st.message().empty()) std::abort();
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  const RegTableEntry live{5, 0x7f0012340000, 65536, 7, 0x1234};
  const RegTableEntry revoked{6, 0x7f0012340000, 65536, 7, 0x1234};
  const RegTableEntry roce{9, 0x20000, 4096, 3, 0x101};
  return {
      input(false, false, 5, 0x7f0012340000, 65536, 7, live, verbs_section(0x1234)),
      input(false, false, 5, 0x7f0012340000, 65536, 2, live, verbs_section(0x1234)),  // fewer rights: fine
      input(false, false, 5, 0x7f0012340000, 65536, 7, revoked, verbs_section(0x1234)),
      input(false, true, 5, 0x7f0012340000, 65536, 7, live, verbs_section(0x1234)),
      input(true, false, 9, 0xdead, 4096, 3, roce, roce_section(0x101, 0x20000)),
      input(true, false, 9, 0xdead, 4096, 4, roce, roce_section(0x101, 0x20000)),  // a right it lacks
  };
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kFixed) return 0;
  const bool roce = (data[0] & 1) != 0, device = (data[0] & 2) != 0;
  RegClaim k;
  k.peer = 1;
  k.slot = 3;
  std::memcpy(&k.gen, data + 1, 8);
  std::memcpy(&k.addr, data + 9, 8);
  std::memcpy(&k.size, data + 17, 8);
  std::memcpy(&k.rights, data + 25, 4);
  RegTableEntry e;
  std::memcpy(&e, data + 29, sizeof e);
  const uint8_t* sec = data + kFixed;
  const size_t len = size - kFixed;
  hcomm::Status st;
  if (roce) {
    uint64_t iova = 0;
    st = parse_npu_roce_key_section(sec, len, &k.key, &iova);
    if (static_cast<bool>(st) != (len == 12)) std::abort();
    if (!st) {
      refused(st, hcomm::Code::protocol_error);
      return 0;
    }
    if (std::memcmp(&k.key, sec, 4) != 0 || std::memcmp(&iova, sec + 4, 8) != 0) std::abort();
    k.addr = iova;  // npu_roce keys are checked by IOVA
  } else {
    st = parse_verbs_key_section(sec, len, device, &k.key);
    if (static_cast<bool>(st) != (len == 4 && !device)) std::abort();
    if (!st) {
      refused(st, hcomm::Code::protocol_error);
      return 0;
    }
    if (std::memcmp(&k.key, sec, 4) != 0) std::abort();
  }
  const bool match = e.gen == k.gen && (e.gen & 1u) != 0 && e.addr == k.addr && e.size == k.size &&
                     (k.rights & ~e.rights) == 0 && e.key == k.key;
  st = check_reg_entry(k, e);
  if (static_cast<bool>(st) != match) std::abort();
  if (!st) refused(st, hcomm::Code::access_denied);
  return 0;
}
