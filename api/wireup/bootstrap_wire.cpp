#include "api/wireup/bootstrap_wire.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "api/wireup/byte_order.h"

namespace hcomm::api::bootwire {

using wire::get32;
using wire::put32;

std::string frame(FrameType type, uint32_t seq, const std::string& payload) {
  std::string f;
  f.reserve(kHeader + payload.size());
  put32(&f, kMagic);
  uint16_t v = htons(kVersion), t = htons(type);
  f.append(reinterpret_cast<const char*>(&v), 2);
  f.append(reinterpret_cast<const char*>(&t), 2);
  put32(&f, seq);
  put32(&f, static_cast<uint32_t>(payload.size()));
  f += payload;
  return f;
}


Status wait_fd(int fd, short events, const Deadline& dl, const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, dl.remaining_ms());
    if (n > 0) return Status::ok();
    if (n == 0) return Status::error(Code::timeout, "%s: deadline passed", what.c_str());
    if (errno != EINTR) return Status::from_errno(errno, what + ": poll");
  }
}

Status write_all(int fd, const std::string& bytes, const Deadline& dl, const std::string& who) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      HCOMM_TRY(wait_fd(fd, POLLOUT, dl, "sending to " + who));
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
      return Status::error(Code::peer_failure, "%s closed its bootstrap connection (exited or killed?)",
                           who.c_str());
    return Status::from_errno(errno, "send to " + who);
  }
  return Status::ok();
}

Status read_exact(int fd, char* buf, size_t len, const Deadline& dl, const std::string& who) {
  size_t off = 0;
  while (off < len) {
    ssize_t n = ::recv(fd, buf + off, len - off, 0);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n == 0 || (n < 0 && errno == ECONNRESET))
      return Status::error(Code::peer_failure, "%s closed its bootstrap connection (exited or killed?)",
                           who.c_str());
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      HCOMM_TRY(wait_fd(fd, POLLIN, dl, "waiting for " + who));
      continue;
    }
    return Status::from_errno(errno, "recv from " + who);
  }
  return Status::ok();
}

Status read_frame(int fd, const Deadline& dl, size_t max_payload, const std::string& who, Frame* f) {
  char h[kHeader];
  HCOMM_TRY(read_exact(fd, h, kHeader, dl, who));
  uint32_t magic = get32(h);
  uint16_t version, type;
  std::memcpy(&version, h + 4, 2);
  std::memcpy(&type, h + 6, 2);
  version = ntohs(version);
  type = ntohs(type);
  uint32_t len = get32(h + 12);
  if (magic != kMagic)
    return Status::error(Code::protocol_error, "bootstrap frame from %s: bad magic 0x%08x", who.c_str(), magic);
  if (version != kVersion)
    return Status::error(Code::protocol_error, "bootstrap frame from %s: version %u, expected %u", who.c_str(),
                         version, kVersion);
  if (type < kHello || type > kAbort)
    return Status::error(Code::protocol_error, "bootstrap frame from %s: unknown type %u", who.c_str(), type);
  size_t cap = type == kAbort ? kMaxAbortMsg + 4 : max_payload;
  if (len > cap)
    return Status::error(Code::protocol_error, "bootstrap frame from %s: length %u exceeds %zu", who.c_str(), len,
                         cap);
  f->type = static_cast<FrameType>(type);
  f->seq = get32(h + 8);
  f->payload.assign(len, '\0');
  return read_exact(fd, f->payload.data(), len, dl, who);
}

std::string abort_payload(const Status& st) {
  std::string p;
  put32(&p, static_cast<uint32_t>(st.code()));
  p += st.message().substr(0, kMaxAbortMsg);
  return p;
}

Status abort_status(const Frame& f, const std::string& who) {
  if (f.payload.size() < 4) return Status::error(Code::protocol_error, "short ABORT frame from %s", who.c_str());
  uint32_t code = get32(f.payload.data());
  // Only failures travel: ok, in_progress and no_resource (retry later) and
  // unknown codes read as peer_failure.
  if (code < static_cast<uint32_t>(Code::invalid_argument) || code > static_cast<uint32_t>(Code::closed))
    code = static_cast<uint32_t>(Code::peer_failure);
  return Status(static_cast<Code>(code), who + " aborted the job: " + f.payload.substr(4));
}

std::string hello_payload(int rank, int size, const std::string& job) {
  std::string p;
  put32(&p, static_cast<uint32_t>(rank));
  put32(&p, static_cast<uint32_t>(size));
  p += job;
  return p;
}

Status parse_hello(const Frame& f, Hello* out) {
  if (f.type != kHello) return Status::error(Code::protocol_error, "first frame is not HELLO");
  if (f.payload.size() < 8) return Status::error(Code::protocol_error, "short HELLO");
  out->rank = get32(f.payload.data());
  out->size = get32(f.payload.data() + 4);
  out->job = f.payload.substr(8);
  return Status::ok();
}

std::string result_payload(const std::vector<std::string>& all) {
  std::string p;
  put32(&p, static_cast<uint32_t>(all.size()));
  for (const auto& s : all) {
    put32(&p, static_cast<uint32_t>(s.size()));
    p += s;
  }
  return p;
}

Status parse_result(const Frame& f, uint32_t seq, int size, std::vector<std::string>* all) {
  const std::string who = "rank 0";
  if (f.type == kAbort) return abort_status(f, who);
  if (f.type != kResult || f.seq != seq)
    return Status::error(Code::protocol_error, "rank 0 sent frame type %u seq %u, expected a RESULT of #%u", f.type,
                         f.seq, seq);
  const std::string& p = f.payload;
  if (p.size() < 4 || get32(p.data()) != static_cast<uint32_t>(size))
    return Status::error(Code::protocol_error, "RESULT from rank 0 does not hold %d blobs", size);
  all->assign(static_cast<size_t>(size), std::string());
  size_t off = 4;
  for (int r = 0; r < size; ++r) {
    if (p.size() - off < 4) return Status::error(Code::protocol_error, "RESULT from rank 0 is truncated");
    size_t len = get32(p.data() + off);
    off += 4;
    if (len > Bootstrap::kMaxBlob || p.size() - off < len)
      return Status::error(Code::protocol_error, "RESULT from rank 0: blob %d has a bad length %zu", r, len);
    (*all)[static_cast<size_t>(r)] = p.substr(off, len);
    off += len;
  }
  if (off != p.size()) return Status::error(Code::protocol_error, "RESULT from rank 0 has trailing bytes");
  return Status::ok();
}

}  // namespace hcomm::api::bootwire
