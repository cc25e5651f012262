// What a peer sends on the mesh (api/wireup/mesh.h, mesh_wire.h), through
// real sockets and the same readers and parsers connect_mesh and the
// context use. The first input byte picks the path:
//   0 a TCP link (SOCK_STREAM, length-framed): the rest is the byte stream;
//     recv_msg reads messages until it refuses one or meets the end;
//   1 a same-host link (SOCK_SEQPACKET with descriptors): the rest is a list
//     of packets, each [flags u8][length u16 LE][bytes]: flags & 31 copies of
//     a descriptor ride along (beyond the 16 a message may carry), flags &
//     0x40 adds kMaxMsg - 8 zero bytes (messages around the size limit);
//   2 a TCP hello (read_tcp_hello + check_tcp_hello), the rest its bytes.
// Every message recv_msg accepts goes through the hello check and the
// control-message parser (advert and segments), as the context would.
// Checked: refusals say why; accepted messages keep the limits (length,
// descriptor count); a parsed TCP hello round-trips through tcp_hello();
// every descriptor that arrived is closed (none leaks).
#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <cstring>

#include "api/wireup/mesh.h"
#include "api/wireup/mesh_wire.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_io.h"

using namespace hcomm::api::meshwire;
using hcomm::Code;
using hcomm::Deadline;
using hcomm::Status;
using hcomm::UniqueFd;
using hcomm::api::kMaxMsg;
using hcomm::api::kMaxMsgFds;
using hcomm::api::MeshLink;

namespace {

const std::string kJob = "job-7";
const std::vector<pid_t> kPids = {100, 101, 102, 103};

void refused(const Status& st) {
  if (st.is_ok() || st.message().empty()) fuzz_io::fail("a refusal without a reason");
}

// What the context and connect_mesh do with one accepted message.
void consume(const std::vector<uint8_t>& m, size_t nfds) {
  if (m.empty() || m.size() > kMaxMsg) fuzz_io::fail("recv_msg accepted a message outside 1..kMaxMsg");
  if (nfds > kMaxMsgFds) fuzz_io::fail("recv_msg accepted too many descriptors");
  int r = -1;
  for (int expect : {-1, 2}) {
    Status st = check_hello(m, kJob, 0, 4, expect, kPids, &r);
    if (st && (r <= 0 || r >= 4 || (expect >= 0 && r != expect))) fuzz_io::fail("check_hello accepted a bad rank");
    if (!st) refused(st);
  }
  CtrlMsg c{};
  Status st = parse_ctrl(m, nfds, CtrlType::advert, 1, 1, 4096, &c);
  if (st && (c.slot >= 4096 || c.rank != 1 || nfds != 1)) fuzz_io::fail("parse_ctrl accepted a bad advert");
  if (!st) refused(st);
  st = parse_ctrl(m, nfds, CtrlType::segments, 2, 2, 0, &c);
  if (st && (c.rank != 2 || nfds != 2)) fuzz_io::fail("parse_ctrl accepted bad segments");
  if (!st) refused(st);
}

void drain(int fd) {
  for (int n = 0; n < 256; ++n) {
    std::vector<uint8_t> m;
    std::vector<UniqueFd> fds;
    Status st = hcomm::api::recv_msg(fd, &m, &fds, Deadline(std::chrono::nanoseconds(0)), 1);
    if (!st) {
      refused(st);
      return;
    }
    consume(m, fds.size());
  }
}

void send_packet(int fd, const std::string& bytes, int nfds) {
  static const int devnull = [] {
    int f = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (f < 0) fuzz_io::fail("open /dev/null");
    return f;
  }();
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 31)] = {};
  if (nfds > 0) {
    mh.msg_control = cbuf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * static_cast<size_t>(nfds));
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * static_cast<size_t>(nfds));
    for (int i = 0; i < nfds; ++i) std::memcpy(CMSG_DATA(c) + i * sizeof(int), &devnull, sizeof(int));
  }
  (void)::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);  // a full socket drops the rest: fine
}

std::string packet(uint8_t flags, const std::string& body) {
  std::string p(3, '\0');
  p[0] = static_cast<char>(flags);
  p[1] = static_cast<char>(body.size() & 0xff);
  p[2] = static_cast<char>(body.size() >> 8);
  return p + body;
}

std::string ctrl(CtrlType t, int rank, uint32_t slot) {
  CtrlMsg m{static_cast<uint32_t>(t), rank, 101, slot, 3, 1};
  return std::string(reinterpret_cast<const char*>(&m), sizeof m);
}

std::string framed(const std::string& body) {
  uint32_t be = htonl(static_cast<uint32_t>(body.size()));
  return std::string(reinterpret_cast<const char*>(&be), 4) + body;
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  const std::string h = hello(2, 102, kJob);
  return {
      std::string(1, '\0') + framed(h) + framed(ctrl(CtrlType::advert, 1, 5)),
      std::string(1, '\0') + framed(std::string(100, 'x')),
      std::string(1, '\1') + packet(1, ctrl(CtrlType::advert, 1, 7)) + packet(2, ctrl(CtrlType::segments, 2, 0)) +
          packet(0, h),
      std::string(1, '\1') + packet(0x40 | 3, "tail") + packet(17, ctrl(CtrlType::advert, 1, 1)),
      std::string(1, '\2') + tcp_hello(kTcpHello, 42, 2, 4),
      std::string(1, '\2') + tcp_hello(kTcpRefuse, 42, 1, 4, "world size differs"),
  };
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (256 << 10)) return 0;
  const int mode = data[0] % 3;
  const uint8_t* in = data + 1;
  const size_t len = size - 1;
  const int fd_mark = fuzz_io::lowest_free_fd();
  if (mode == 0) {
    fuzz_io::Pair pair(SOCK_STREAM);
    pair.write_and_close(in, len);
    drain(pair.fd[0]);
  } else if (mode == 1) {
    fuzz_io::Pair pair(SOCK_SEQPACKET);
    size_t off = 0;
    while (len - off >= 3) {
      const uint8_t flags = in[off];
      size_t n = in[off + 1] | (size_t{in[off + 2]} << 8);
      off += 3;
      n = std::min(n, len - off);
      std::string body(reinterpret_cast<const char*>(in + off), n);
      off += n;
      if (flags & 0x40) body.resize(body.size() + kMaxMsg - 8);
      send_packet(pair.fd[1], body, flags & 31);
    }
    pair.close_writer();
    drain(pair.fd[0]);
  } else {
    fuzz_io::Pair pair(SOCK_STREAM);
    pair.write_and_close(in, len);
    TcpHello h;
    Status st = read_tcp_hello(pair.fd[0], Deadline::after_ms(1000), -1, &h);
    if (!st) {
      refused(st);
    } else {
      if (h.text.size() > kMaxRefuse) fuzz_io::fail("hello text beyond kMaxRefuse");
      std::vector<MeshLink> links(4);
      links[1].same_host = false;
      links[3].same_host = false;
      links[3].fd.reset(::dup(STDERR_FILENO));  // rank 3 is connected already
      for (int expect : {-1, 2}) {
        Status c = check_tcp_hello(h, 42, 0, 4, expect, links);
        if (!c) refused(c);
        else if (h.rank >= 4 || (expect < 0 && (h.rank == 0 || h.rank == 2 || h.rank == 3)))
          fuzz_io::fail("check_tcp_hello accepted a rank it must refuse");
      }
      if (h.version == hcomm::api::kMeshTcpVersion &&
          tcp_hello(h.type, h.cookie, static_cast<int>(h.rank), static_cast<int>(h.size), h.text) !=
              std::string(reinterpret_cast<const char*>(in), 28 + h.text.size()))
        fuzz_io::fail("a TCP hello does not round-trip");
    }
  }
  if (fuzz_io::lowest_free_fd() != fd_mark) fuzz_io::fail("a descriptor leaked");
  return 0;
}
