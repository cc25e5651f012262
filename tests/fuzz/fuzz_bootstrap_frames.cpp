// What a peer sends the TCP bootstrap (api/wireup/bootstrap_wire.h), read
// from a real socket with the same reader, limits and parsers the
// rendezvous uses. The first input byte picks whose view is fuzzed:
//   0 rank 0 accepting a connection: one frame of at most kMaxHello bytes,
//     which must be a HELLO (parse_hello);
//   1 rank 0 in a collective: CONTRIB frames of at most kMaxBlob bytes;
//   2 a rank waiting for rank 0's answer: RESULT or ABORT (parse_result) of
//     a job of 1 + (second byte % 8) ranks.
// The rest is the byte stream, after which the peer closes. Frames are read
// until the reader refuses one or meets the end. Every refusal must say
// why; whatever is accepted must keep the stated limits. A frame built by
// frame() must read back unchanged (checked on the seeds' payloads).
#include <sys/socket.h>

#include <cstring>

#include "api/wireup/bootstrap_wire.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_io.h"

using namespace hcomm::api::bootwire;
using hcomm::Code;
using hcomm::Deadline;
using hcomm::Status;
using hcomm::api::Bootstrap;

namespace {

void refused(const Status& st) {
  if (st.is_ok() || st.message().empty()) fuzz_io::fail("a refusal without a reason");
  if (st.code() == Code::in_progress || st.code() == Code::no_resource)
    fuzz_io::fail("a refusal that reads as 'retry later'");
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  const std::string hello = frame(kHello, 0, hello_payload(1, 4, "job-7"));
  const std::string contrib = frame(kContrib, 1, "blob") + frame(kContrib, 2, std::string(300, 'x'));
  const std::string result = frame(kResult, 1, result_payload({"a", "", "ccc"}));
  const std::string abort = frame(kAbort, 1, abort_payload(Status::error(Code::timeout, "rank 2 did not arrive")));
  return {std::string(1, '\0') + hello, std::string(1, '\1') + contrib, std::string("\2\2") + result,
          std::string("\2\2") + abort, std::string("\2\0", 2) + frame(kResult, 1, result_payload({"x"}))};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2 || size > (512 << 10)) return 0;
  const int role = data[0] % 3;
  const int ranks = 1 + data[1] % 8;
  const uint8_t* stream = data + (role == 2 ? 2 : 1);
  const size_t len = size - (role == 2 ? 2 : 1);
  const int fd_mark = fuzz_io::lowest_free_fd();
  {
    fuzz_io::Pair pair(SOCK_STREAM);
    pair.write_and_close(stream, len);
    const int fd = pair.fd[0];
    const Deadline dl = Deadline::after_ms(1000);  // never needed: the writer has closed
    for (int n = 0; n < 64; ++n) {
      Frame f;
      const size_t cap = role == 0 ? kMaxHello : role == 1 ? Bootstrap::kMaxBlob : 4 + ranks * (4 + Bootstrap::kMaxBlob);
      Status st = read_frame(fd, dl, cap, "the peer", &f);
      if (!st) {
        refused(st);
        break;
      }
      if (f.payload.size() > (f.type == kAbort ? kMaxAbortMsg + 4 : cap)) fuzz_io::fail("a frame beyond its cap");
      if (role == 0) {
        Hello h;
        st = parse_hello(f, &h);
        if (!st) {
          refused(st);
          break;
        }
        if (h.job.size() + 8 != f.payload.size()) fuzz_io::fail("HELLO job id length");
        // What rank 0 then sends back: the frame round-trips through frame().
        if (frame(kHello, f.seq, hello_payload(static_cast<int>(h.rank), static_cast<int>(h.size), h.job)) !=
            frame(f.type, f.seq, f.payload))
          fuzz_io::fail("HELLO does not round-trip");
      } else if (role == 1) {
        if (f.type != kContrib) break;  // rank 0 fails the collective (protocol_error)
      } else {
        std::vector<std::string> all;
        st = parse_result(f, 1, ranks, &all);
        if (!st) {
          refused(st);
          if (f.type == kAbort && f.payload.size() >= 4 && st.message().find("aborted the job") == std::string::npos)
            fuzz_io::fail("ABORT not reported as such");
          break;
        }
        if (all.size() != static_cast<size_t>(ranks)) fuzz_io::fail("RESULT blob count");
        for (const auto& b : all)
          if (b.size() > Bootstrap::kMaxBlob) fuzz_io::fail("RESULT blob beyond kMaxBlob");
        if (result_payload(all) != f.payload) fuzz_io::fail("RESULT does not round-trip");
      }
    }
  }
  if (fuzz_io::lowest_free_fd() != fd_mark) fuzz_io::fail("a descriptor leaked");
  return 0;
}
