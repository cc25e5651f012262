// Unit: the mesh message helpers over a socketpair: data and descriptors
// arrive, limits are enforced on both ends, a closed peer and silence are
// reported with the right codes, nothing leaks.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "api/wireup/mesh.h"

namespace hcomm::api {
namespace {

int open_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n - 1;  // the DIR's own
}

class MeshMsg : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
    a_.reset(sv[0]);
    b_.reset(sv[1]);
  }
  // Sends raw bytes and `n` fds with sendmsg, bypassing send_msg's checks.
  static ssize_t raw_send(int fd, const std::string& data, int nfds) {
    iovec iov{const_cast<char*>(data.data()), data.size()};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    std::vector<char> cbuf(CMSG_SPACE(sizeof(int) * static_cast<size_t>(nfds)));
    std::vector<int> fds(static_cast<size_t>(nfds), 0);  // stdin, duplicated nfds times
    if (nfds > 0) {
      mh.msg_control = cbuf.data();
      mh.msg_controllen = cbuf.size();
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    return ::sendmsg(fd, &mh, MSG_NOSIGNAL);
  }

  UniqueFd a_, b_;
};

TEST_F(MeshMsg, DataAndDescriptorsArrive) {
  int p1[2], p2[2];
  ASSERT_EQ(::pipe(p1), 0);
  ASSERT_EQ(::pipe(p2), 0);
  UniqueFd r1(p1[0]), w1(p1[1]), r2(p2[0]), w2(p2[1]);
  const int pass[] = {w1.get(), w2.get()};
  std::string msg = "two pipes";
  ASSERT_TRUE(send_msg(a_.get(), msg.data(), msg.size(), pass));
  std::vector<uint8_t> out;
  std::vector<UniqueFd> fds;
  Status st = recv_msg(b_.get(), &out, &fds, Deadline::after_ms(1000));
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(std::string(out.begin(), out.end()), msg);
  ASSERT_EQ(fds.size(), 2u);
  for (auto& f : fds) EXPECT_NE(::fcntl(f.get(), F_GETFD) & FD_CLOEXEC, 0) << "MSG_CMSG_CLOEXEC";
  // The received descriptors are the pipes' write ends: prove it.
  ASSERT_EQ(::write(fds[0].get(), "1", 1), 1);
  ASSERT_EQ(::write(fds[1].get(), "2", 1), 1);
  char c = 0;
  ASSERT_EQ(::read(r1.get(), &c, 1), 1);
  EXPECT_EQ(c, '1');
  ASSERT_EQ(::read(r2.get(), &c, 1), 1);
  EXPECT_EQ(c, '2');
}

TEST_F(MeshMsg, LargestMessageRoundTrips) {
  std::string big(kMaxMsg, 'q');
  big.front() = 'a';
  big.back() = 'z';
  ASSERT_TRUE(send_msg(a_.get(), big.data(), big.size(), {}, Deadline::after_ms(1000)));
  std::vector<uint8_t> out;
  ASSERT_TRUE(recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(1000)));
  EXPECT_EQ(std::string(out.begin(), out.end()), big);
}

TEST_F(MeshMsg, SenderRefusesWhatTheReceiverWouldReject) {
  std::string big(kMaxMsg + 1, 'x');
  EXPECT_EQ(send_msg(a_.get(), big.data(), big.size()).code(), Code::invalid_argument);
  EXPECT_EQ(send_msg(a_.get(), "x", 0).code(), Code::invalid_argument);
  EXPECT_EQ(send_msg(a_.get(), nullptr, 1).code(), Code::invalid_argument);
  std::vector<int> many(kMaxMsgFds + 1, 0);
  EXPECT_EQ(send_msg(a_.get(), "x", 1, many).code(), Code::invalid_argument);
}

TEST_F(MeshMsg, OversizedMessageIsProtocolErrorAndTheSocketStaysUsable) {
  ASSERT_EQ(raw_send(a_.get(), std::string(kMaxMsg + 100, 'x'), 0), static_cast<ssize_t>(kMaxMsg + 100));
  ASSERT_TRUE(send_msg(a_.get(), "next", 4));
  std::vector<uint8_t> out;
  Status st = recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(1000));
  EXPECT_EQ(st.code(), Code::protocol_error) << st.to_string();
  ASSERT_TRUE(recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(1000)));
  EXPECT_EQ(std::string(out.begin(), out.end()), "next");
}

TEST_F(MeshMsg, TooManyDescriptorsIsProtocolErrorWithoutLeaks) {
  int before = open_fds();
  ASSERT_GT(raw_send(a_.get(), "fds", static_cast<int>(kMaxMsgFds) + 8), 0);
  std::vector<uint8_t> out;
  std::vector<UniqueFd> fds;
  Status st = recv_msg(b_.get(), &out, &fds, Deadline::after_ms(1000));
  EXPECT_EQ(st.code(), Code::protocol_error) << st.to_string();
  EXPECT_TRUE(fds.empty());
  EXPECT_EQ(open_fds(), before) << "descriptors of a rejected message must be closed";
}

TEST_F(MeshMsg, UnexpectedDescriptorsAreRejectedAndClosed) {
  int before = open_fds();
  ASSERT_GT(raw_send(a_.get(), "fds", 2), 0);
  std::vector<uint8_t> out;
  EXPECT_EQ(recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(1000)).code(), Code::protocol_error);
  EXPECT_EQ(open_fds(), before);
}

TEST_F(MeshMsg, PeerClosedIsPeerFailureNamingTheRank) {
  a_.reset();
  std::vector<uint8_t> out;
  Status st = recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(1000), 3);
  EXPECT_EQ(st.code(), Code::peer_failure);
  EXPECT_NE(st.message().find("rank 3"), std::string::npos) << st.message();
  st = send_msg(b_.get(), "x", 1, {}, 5);
  EXPECT_EQ(st.code(), Code::peer_failure) << st.to_string();
  EXPECT_NE(st.message().find("rank 5"), std::string::npos) << st.message();
}

TEST_F(MeshMsg, SilenceIsTimeoutWithinTheDeadline) {
  std::vector<uint8_t> out;
  auto t0 = std::chrono::steady_clock::now();
  Status st = recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(100), 1);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(st.code(), Code::timeout) << st.to_string();
  EXPECT_GE(ms, 90);
  EXPECT_LT(ms, 3000);  // bounded by the deadline, with scheduling slack
}

TEST_F(MeshMsg, FullSocketIsBackPressureThenTimeout) {
  std::string m(4096, 'f');
  Status st;
  int sent = 0;
  while ((st = send_msg(a_.get(), m.data(), m.size())).is_ok()) ASSERT_LT(++sent, 100000);
  EXPECT_EQ(st.code(), Code::no_resource) << st.to_string();
  EXPECT_GT(sent, 0);
  st = send_msg(a_.get(), m.data(), m.size(), {}, Deadline::after_ms(50), 2);
  EXPECT_EQ(st.code(), Code::timeout) << st.to_string();
  // Draining one message makes room again.
  std::vector<uint8_t> out;
  ASSERT_TRUE(recv_msg(b_.get(), &out, nullptr, Deadline::after_ms(1000)));
  EXPECT_TRUE(send_msg(a_.get(), m.data(), m.size(), {}, Deadline::after_ms(1000)));
}

}  // namespace
}  // namespace hcomm::api
