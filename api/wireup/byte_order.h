// Network byte order on the wire-up protocols (the TCP bootstrap, the store
// bootstrap's value header, the mesh's TCP hello): append a big-endian
// integer to a message, read one from a buffer.
#pragma once

#include <arpa/inet.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace hcomm::api::wire {

inline void put16(std::string* s, uint16_t v) {
  const uint16_t be = htons(v);
  s->append(reinterpret_cast<const char*>(&be), 2);
}
inline void put32(std::string* s, uint32_t v) {
  const uint32_t be = htonl(v);
  s->append(reinterpret_cast<const char*>(&be), 4);
}
inline uint16_t get16(const void* p) {
  uint16_t be;
  std::memcpy(&be, p, 2);
  return ntohs(be);
}
inline uint32_t get32(const void* p) {
  uint32_t be;
  std::memcpy(&be, p, 4);
  return ntohl(be);
}

}  // namespace hcomm::api::wire
