// Bootstrap::from_store: the bootstrap over a key-value store the job
// already runs. Key layout and failure rules: see bootstrap.h.
#include <arpa/inet.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "api/wireup/bootstrap.h"
#include "api/wireup/byte_order.h"

namespace hcomm::api {

namespace {

// Value = 16-byte header in network byte order, then the blob:
//   magic 'HCKV' u32 | version u16 | kind u16 | world size u32 | rank u32
constexpr uint32_t kValueMagic = 0x48434b56;  // "HCKV"
constexpr uint16_t kValueVersion = 1;
constexpr size_t kValueHeader = 16;
static_assert(Bootstrap::kMaxBlob + kValueHeader <= KvStore::kMaxValue, "a blob and its header fit one store value");
// How often a wait looks at the abort key.
constexpr auto kAbortPoll = std::chrono::milliseconds(200);
constexpr size_t kMaxAbortMsg = 4096;

using wire::get16;
using wire::get32;
using wire::put16;
using wire::put32;

std::string list_ranks(const std::vector<int>& rs) {
  std::string s;
  for (int r : rs) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

class StoreBootstrap final : public Bootstrap {
 public:
  StoreBootstrap(int rank, int size, std::string job, std::unique_ptr<KvStore> store, int timeout_ms)
      : Bootstrap(rank, size, std::move(job)),
        _store(std::move(store)),
        _prefix("hcomm/" + job_id() + "/"),
        _timeout_ms(timeout_ms) {}

  // Collective #0: returns once every rank has set its join key.
  Status join(const Deadline& dl) {
    std::vector<std::string> ignored;
    Status st = collect(0, Collective::join, std::string(), &ignored, dl);
    if (!st) broken(st);
    return st;
  }

 protected:
  Status exchange(uint32_t seq, Collective kind, const std::string& mine, std::vector<std::string>* all,
                  const Deadline& dl) override {
    return collect(seq + 1, kind, mine, all, dl);
  }

  // Tell the others why, so that they fail now with our reason instead of
  // timing out on a key we will never set. Best effort (the store may be
  // what failed); not when the reason is someone else's abort (already there).
  void broken(const Status& why) noexcept override {
    if (_peer_aborted) return;
    std::string v;
    put32(&v, static_cast<uint32_t>(why.code()));
    v += ("rank " + std::to_string(rank()) + ": " + why.message()).substr(0, kMaxAbortMsg);
    (void)_store->set(_prefix + "abort", v);
  }

 private:
  static const char* kind_name(Collective k) {
    switch (k) {
      case Collective::join: return "join";
      case Collective::allgather: return "allgather";
      case Collective::barrier: return "barrier";
    }
    return "collective";
  }

  std::string key(uint32_t s, int r) const { return _prefix + std::to_string(s) + "/" + std::to_string(r); }

  // A store call failed: say which rank and collective.
  Status store_error(const Status& st, uint32_t s) const {
    return Status(st.code(), "rank " + std::to_string(rank()) + ": store bootstrap, collective #" +
                                 std::to_string(s) + ": " + st.message());
  }

  // Waits for `k` in slices of kAbortPoll, looking at the abort key between
  // slices. timeout only once the deadline has passed.
  Status wait_key(const std::string& k, std::string* v, const Deadline& dl) {
    for (;;) {
      auto left = dl.at() - Clock::now();
      Deadline slice(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::max<Clock::duration>(Clock::duration::zero(), std::min<Clock::duration>(left, kAbortPoll))));
      Status st = _store->get(k, v, slice);
      if (st.code() != Code::timeout) return st;
      std::string why;
      Status ab = _store->get(_prefix + "abort", &why, Deadline(std::chrono::nanoseconds(0)));
      if (ab) {
        _peer_aborted = true;
        uint32_t code = why.size() >= 4 ? get32(why.data()) : 0;
        if (code <= static_cast<uint32_t>(Code::ok) || code > static_cast<uint32_t>(Code::closed))
          code = static_cast<uint32_t>(Code::peer_failure);
        return Status(static_cast<Code>(code), "job \"" + job_id() + "\" aborted by " +
                                                   (why.size() >= 4 ? why.substr(4) : std::string("a rank")));
      }
      if (ab.code() != Code::timeout) return ab;
      if (dl.expired()) return st;
      idle();
    }
  }

  Status check_value(const std::string& v, uint32_t s, Collective kind, int r) const {
    if (v.size() < kValueHeader || get32(v.data()) != kValueMagic)
      return Status::error(Code::protocol_error, "store bootstrap: %s does not hold an hcomm bootstrap value",
                           key(s, r).c_str());
    if (uint16_t ver = get16(v.data() + 4); ver != kValueVersion)
      return Status::error(Code::protocol_error, "store bootstrap: rank %d speaks version %u, rank %d version %u", r,
                           ver, rank(), kValueVersion);
    if (uint32_t sz = get32(v.data() + 8); sz != static_cast<uint32_t>(size()))
      return Status::error(Code::protocol_error, "store bootstrap: world size mismatch: rank %d has %u, rank %d has %d",
                           r, sz, rank(), size());
    if (uint32_t their = get32(v.data() + 12); their != static_cast<uint32_t>(r))
      return Status::error(Code::protocol_error, "store bootstrap: %s was written by rank %u", key(s, r).c_str(), their);
    if (uint16_t k = get16(v.data() + 6); k != static_cast<uint16_t>(kind)) {
      const char* theirs = k >= 1 && k <= 3 ? kind_name(static_cast<Collective>(k)) : "unknown collective";
      return Status::error(Code::protocol_error,
                           "store bootstrap: collective #%u: rank %d is in a %s, rank %d in a %s (collectives called "
                           "in a different order?)",
                           s, r, theirs, rank(), kind_name(kind));
    }
    if (v.size() - kValueHeader > kMaxBlob)
      return Status::error(Code::protocol_error, "store bootstrap: rank %d contributed %zu bytes, more than %zu", r,
                           v.size() - kValueHeader, kMaxBlob);
    return Status::ok();
  }

  Status collect(uint32_t s, Collective kind, const std::string& mine, std::vector<std::string>* all,
                 const Deadline& dl) {
    std::string v;
    put32(&v, kValueMagic);
    put16(&v, kValueVersion);
    put16(&v, static_cast<uint16_t>(kind));
    put32(&v, static_cast<uint32_t>(size()));
    put32(&v, static_cast<uint32_t>(rank()));
    v += mine;
    if (Status st = _store->set(key(s, rank()), v); !st) return store_error(st, s);
    all->assign(static_cast<size_t>(size()), std::string());
    (*all)[static_cast<size_t>(rank())] = mine;
    // Everyone after us first, then everyone before: the ranks a missing one
    // holds up are the same either way; this only spreads the store's load.
    for (int i = 1; i < size(); ++i) {
      int r = (rank() + i) % size();
      Status st = wait_key(key(s, r), &v, dl);
      if (st.code() == Code::timeout) return missing(s, kind, r, i);
      if (!st) return _peer_aborted ? st : store_error(st, s);
      HCOMM_TRY(check_value(v, s, kind, r));
      (*all)[static_cast<size_t>(r)] = v.substr(kValueHeader);
    }
    return Status::ok();
  }

  // `first` (the i-th rank we waited for) did not contribute before the
  // deadline; look once at the ranks after it so that the message names all.
  Status missing(uint32_t s, Collective kind, int first, int i) {
    std::vector<int> absent{first};
    for (++i; i < size(); ++i) {
      int r = (rank() + i) % size();
      std::string v;
      if (_store->get(key(s, r), &v, Deadline(std::chrono::nanoseconds(0))).code() == Code::timeout)
        absent.push_back(r);
    }
    std::sort(absent.begin(), absent.end());
    const char* plural = absent.size() > 1 ? "s" : "";
    if (kind == Collective::join)
      return Status::error(Code::timeout,
                           "rank %d: rank%s %s of %d did not join the store rendezvous (job \"%s\") within %d ms",
                           rank(), plural, list_ranks(absent).c_str(), size(), job_id().c_str(), _timeout_ms);
    return Status::error(Code::timeout,
                         "rank %d: store bootstrap, collective #%u: rank%s %s of %d did not contribute before the "
                         "deadline (no key %s)",
                         rank(), s, plural, list_ranks(absent).c_str(), size(), key(s, absent[0]).c_str());
  }

  std::unique_ptr<KvStore> _store;
  std::string _prefix;  // "hcomm/<job>/"
  int _timeout_ms;
  bool _peer_aborted = false;  // the failure is another rank's abort
};

}  // namespace

Status Bootstrap::from_store(int rank, int size, std::string job_id, std::unique_ptr<KvStore> store, int timeout_ms,
                             std::unique_ptr<Bootstrap>* out) {
  if (out == nullptr) return Status::error(Code::invalid_argument, "Bootstrap::from_store: null output");
  if (size < 1 || size > kMaxRanks)
    return Status::error(Code::invalid_argument, "world size %d is outside [1, %d]", size, kMaxRanks);
  if (rank < 0 || rank >= size)
    return Status::error(Code::invalid_argument, "rank %d is outside [0, %d)", rank, size);
  if (timeout_ms <= 0) return Status::error(Code::invalid_argument, "timeout_ms must be positive, got %d", timeout_ms);
  if (job_id.size() > kMaxJobId) return Status::error(Code::invalid_argument, "job id longer than %zu bytes", kMaxJobId);
  if (store == nullptr && size > 1) return Status::error(Code::invalid_argument, "Bootstrap::from_store: no store");
  if (job_id.empty()) job_id = "store";
  auto b = std::make_unique<StoreBootstrap>(rank, size, std::move(job_id), std::move(store), timeout_ms);
  if (size > 1) HCOMM_TRY(b->join(Deadline::after_ms(timeout_ms)));
  *out = std::move(b);
  return Status::ok();
}

}  // namespace hcomm::api
