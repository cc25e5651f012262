// boot_check: a tiny rank program for launcher tests (hcomm-run, mpirun).
// Detects the launch, bootstraps, allgathers, builds the mesh, sends every
// peer a message (with a descriptor to peers on this host; none can cross
// hosts), says goodbye on every link, and prints one line:
//   boot_check rank R/N source=S ok
// Exit 0 on success; 1 with the reason on stderr otherwise.
#include <unistd.h>

#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "api/wireup/mesh.h"

using namespace hcomm;

static int fail(const char* what, const Status& st) {
  std::fprintf(stderr, "boot_check: %s: %s\n", what, st.to_string().c_str());
  return 1;
}

int main() {
  api::LaunchInfo li;
  Status st = api::detect_launch(&li);
  if (!st) return fail("detect_launch", st);
  std::unique_ptr<api::Bootstrap> boot;
  st = api::Bootstrap::create(li, 30000, &boot);
  if (!st) return fail("bootstrap", st);
  Deadline dl = Deadline::after_ms(30000);
  std::vector<std::string> all;
  st = boot->allgather("rank " + std::to_string(li.rank), &all, dl);
  if (!st) return fail("allgather", st);
  for (int r = 0; r < li.size; ++r)
    if (all[static_cast<size_t>(r)] != "rank " + std::to_string(r)) {
      std::fprintf(stderr, "boot_check: allgather slot %d holds \"%s\"\n", r, all[static_cast<size_t>(r)].c_str());
      return 1;
    }
  std::vector<api::MeshLink> peers;
  st = api::connect_mesh(*boot, dl, &peers);
  if (!st) return fail("connect_mesh", st);
  for (int p = 0; p < li.size; ++p) {
    if (p == li.rank) continue;
    int fds[1] = {0};  // stdin: any descriptor will do
    std::span<const int> pass;
    if (peers[static_cast<size_t>(p)].same_host) pass = fds;
    std::string m = "hello " + std::to_string(li.rank);
    st = api::send_msg(peers[static_cast<size_t>(p)].fd.get(), m.data(), m.size(), pass, dl, p);
    if (!st) return fail("send_msg", st);
  }
  for (int p = 0; p < li.size; ++p) {
    if (p == li.rank) continue;
    std::vector<uint8_t> m;
    std::vector<UniqueFd> got;
    const auto& link = peers[static_cast<size_t>(p)];
    st = api::recv_msg(link.fd.get(), &m, &got, dl, p);
    if (!st) return fail("recv_msg", st);
    const size_t want_fds = link.same_host ? 1 : 0;
    if (std::string(m.begin(), m.end()) != "hello " + std::to_string(p) || got.size() != want_fds ||
        (want_fds == 1 && !got[0].valid())) {
      std::fprintf(stderr, "boot_check: bad message from rank %d\n", p);
      return 1;
    }
  }
  st = boot->barrier(dl);
  if (!st) return fail("barrier", st);
  for (auto& link : peers) {
    st = api::mesh_goodbye(link, dl);
    if (!st) return fail("mesh_goodbye", st);
  }
  std::printf("boot_check rank %d/%d source=%s ok\n", li.rank, li.size, li.source.c_str());
  return 0;
}
