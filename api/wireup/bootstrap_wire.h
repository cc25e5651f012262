// The TCP bootstrap's wire format (Bootstrap::create), apart so that the
// frame reader and the payload parsers are fuzzed exactly as the rendezvous
// runs them (tests/fuzz/fuzz_bootstrap_frames.cpp).
//
// Every frame: a 16-byte header in network byte order, then `length` bytes.
//   magic 'HCBS' | version u16 | type u16 | seq u32 | length u32
// HELLO   leaf -> root  u32 rank, u32 size, job id bytes
// WELCOME root -> leaf  empty: everyone has joined
// CONTRIB leaf -> root  the blob of collective #seq
// RESULT  root -> leaf  u32 count, then count x (u32 len, bytes)
// ABORT   root -> leaf  u32 code, message bytes: the job failed, and why
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api::bootwire {

constexpr uint32_t kMagic = 0x48434253;  // "HCBS"
constexpr uint16_t kVersion = 1;
enum FrameType : uint16_t { kHello = 1, kWelcome, kContrib, kResult, kAbort };
constexpr size_t kHeader = 16;
constexpr size_t kMaxJobId = Bootstrap::kMaxJobId;
constexpr size_t kMaxAbortMsg = 4096;
// Largest HELLO payload the root reads.
constexpr size_t kMaxHello = 8 + kMaxJobId;

struct Frame {
  FrameType type = kHello;
  uint32_t seq = 0;
  std::string payload;
};

std::string frame(FrameType type, uint32_t seq, const std::string& payload);

// Waits for `events` on fd until the deadline: ok, or timeout.
Status wait_fd(int fd, short events, const Deadline& dl, const std::string& what);
// `who` names the other side in messages ("rank 3"). A closed peer is
// peer_failure.
Status write_all(int fd, const std::string& bytes, const Deadline& dl, const std::string& who);
Status read_exact(int fd, char* buf, size_t len, const Deadline& dl, const std::string& who);
// Reads one frame; the header (magic, version, type, length against
// max_payload, or kMaxAbortMsg + 4 for ABORT) is validated before any payload
// is read, so a garbage length never makes us allocate. protocol_error names
// what was wrong.
Status read_frame(int fd, const Deadline& dl, size_t max_payload, const std::string& who, Frame* f);

std::string hello_payload(int rank, int size, const std::string& job);
struct Hello {
  uint32_t rank = 0;
  uint32_t size = 0;
  std::string job;
};
// A connecting rank's first frame: a HELLO of at least 8 bytes. The caller
// checks the rank, size and job against its own.
Status parse_hello(const Frame& f, Hello* out);

// RESULT's payload: every rank's blob, in rank order.
std::string result_payload(const std::vector<std::string>& all);
// A leaf's answer to collective #seq of a `size`-rank job: ABORT becomes the
// root's reason (abort_status); anything but a RESULT of #seq holding exactly
// `size` blobs of at most Bootstrap::kMaxBlob bytes, without trailing bytes,
// is protocol_error.
Status parse_result(const Frame& f, uint32_t seq, int size, std::vector<std::string>* all);

std::string abort_payload(const Status& st);
// An ABORT frame's status: its code (an unknown one reads as peer_failure)
// and "<who> aborted the job: <message>".
Status abort_status(const Frame& f, const std::string& who);

}  // namespace hcomm::api::bootwire
