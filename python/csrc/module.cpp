// The extension module hcomm._C: the backend's creator, tensor windows
// (one-sided put/get/accumulate/notify/fetch_add on registered tensors) and
// hcomm.torch.empty (tensors in hcomm memory).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <stdexcept>

#include "python/csrc/backend.h"

namespace py = pybind11;

namespace hcomm::torch_backend {
namespace {

hcomm_dtype_t dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kChar: return HCOMM_INT8;
    case at::kShort: return HCOMM_INT16;
    case at::kInt: return HCOMM_INT32;
    case at::kLong: return HCOMM_INT64;
    case at::kByte: return HCOMM_UINT8;
    case at::kHalf: return HCOMM_FP16;
    case at::kBFloat16: return HCOMM_BF16;
    case at::kFloat: return HCOMM_FP32;
    case at::kDouble: return HCOMM_FP64;
    default: break;
  }
  throw std::invalid_argument(std::string("hcomm: accumulate has no ") + c10::toString(t) +
                              " (int8/16/32/64, uint8, float16, bfloat16, float32, float64)");
}

// A registered tensor that peers reach without taking part. Keys are
// exchanged by the Python side (all_gather over the group); offsets are in
// elements of the window's dtype.
class Window {
 public:
  Window(const c10::intrusive_ptr<ProcessGroupHcomm>& pg, const at::Tensor& t) : _pg(pg), _world(pg->world()), _t(t) {
    check_tensor(t, "Window");
    hcomm_context_t* ctx = _world->ctx();
    const size_t bytes = std::max<size_t>(t.nbytes(), 1);
    _mem = _world->find_registration(t.data_ptr(), bytes);
    if (_mem == nullptr) {
      hcomm_status_t st = hcomm_mem_register(ctx, t.data_ptr(), bytes, HCOMM_ACCESS_ALL, &_mem);
      if (st == HCOMM_ERR_UNSUPPORTED)
        raise(st, "Window: this engine cannot register a tensor's own memory; allocate it with hcomm.torch.empty()");
      check(st, "Window: registering the tensor");
      _owned = true;
      _world->add_registration(_mem, t.data_ptr(), bytes);
    }
    _base = static_cast<uint64_t>(static_cast<uint8_t*>(t.data_ptr()) - static_cast<uint8_t*>(hcomm_mem_ptr(_mem)));
    // One notify word per group rank: put_notify from rank r sets word r.
    check(hcomm_mem_alloc(ctx, 8 * static_cast<size_t>(pg->getSize()), HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &_notify),
          "Window: notify words");
    std::memset(hcomm_mem_ptr(_notify), 0, 8 * static_cast<size_t>(pg->getSize()));
  }
  ~Window() { free(); }

  // [u64 base][u64 bytes][u16 n][data key][u16 n][notify key]
  py::bytes keys() const {
    uint8_t k[HCOMM_RKEY_MAX];
    std::string out(16, '\0');
    const uint64_t bytes = _t.nbytes();
    std::memcpy(out.data(), &_base, 8);
    std::memcpy(out.data() + 8, &bytes, 8);
    for (hcomm_mem_t* m : {_mem, _notify}) {
      size_t len = sizeof k;
      check(hcomm_mem_rkey_pack(m, k, &len), "Window: packing a key");
      const uint16_t n = static_cast<uint16_t>(len);
      out.append(reinterpret_cast<const char*>(&n), 2);
      out.append(reinterpret_cast<const char*>(k), len);
    }
    return py::bytes(out);
  }

  void connect(const std::vector<std::string>& all) {
    TORCH_CHECK(static_cast<int>(all.size()) == _pg->getSize(), "hcomm: Window: ", all.size(), " keys for a group of ",
                _pg->getSize());
    for (size_t r = 0; r < all.size(); ++r) {
      const std::string& b = all[r];
      Peer p;
      size_t at = 16;
      TORCH_CHECK(b.size() >= 20, "hcomm: Window: rank ", r, "'s keys are damaged");
      std::memcpy(&p.base, b.data(), 8);
      std::memcpy(&p.bytes, b.data() + 8, 8);
      for (hcomm_rkey_t** k : {&p.data, &p.notify}) {
        uint16_t n = 0;
        TORCH_CHECK(at + 2 <= b.size(), "hcomm: Window: rank ", r, "'s keys are damaged");
        std::memcpy(&n, b.data() + at, 2);
        TORCH_CHECK(at + 2 + n <= b.size(), "hcomm: Window: rank ", r, "'s keys are damaged");
        check(hcomm_rkey_import(_world->ctx(), _pg->world_rank(static_cast<int>(r)), b.data() + at + 2, n, k),
              "Window: importing rank " + std::to_string(r) + "'s key");
        at += 2 + n;
      }
      _peers.push_back(p);
    }
  }

  c10::intrusive_ptr<c10d::Work> put(const at::Tensor& src, int rank, int64_t offset) {
    return rma("put", src, rank, offset, [&](const Peer& p, uint64_t off, const at::Tensor& l, hcomm_request_t** q) {
      return hcomm_iput(_world->ctx(), l.data_ptr(), l.nbytes(), p.data, off, q);
    });
  }
  c10::intrusive_ptr<c10d::Work> get(const at::Tensor& dst, int rank, int64_t offset) {
    return rma(
        "get", dst, rank, offset,
        [&](const Peer& p, uint64_t off, const at::Tensor& l, hcomm_request_t** q) {
          return hcomm_iget(_world->ctx(), l.data_ptr(), l.nbytes(), p.data, off, q);
        },
        true);
  }
  c10::intrusive_ptr<c10d::Work> accumulate(const at::Tensor& src, int rank, int64_t offset, int op) {
    if (op < HCOMM_SUM || op > HCOMM_MIN) throw std::invalid_argument("hcomm: accumulate op must be SUM, PROD, MAX or MIN");
    const hcomm_dtype_t dt = dtype_of(_t.scalar_type());
    return rma("accumulate", src, rank, offset, [&](const Peer& p, uint64_t off, const at::Tensor& l, hcomm_request_t** q) {
      return hcomm_iaccumulate(_world->ctx(), l.data_ptr(), static_cast<size_t>(l.numel()), dt,
                               static_cast<hcomm_op_t>(op), p.data, off, q);
    });
  }
  c10::intrusive_ptr<c10d::Work> put_notify(const at::Tensor& src, int rank, int64_t offset, uint64_t value) {
    const uint64_t word = 8 * static_cast<uint64_t>(_pg->getRank());
    return rma("put_notify", src, rank, offset,
               [&](const Peer& p, uint64_t off, const at::Tensor& l, hcomm_request_t** q) {
                 return hcomm_iput_notify(_world->ctx(), l.data_ptr(), l.nbytes(), p.data, off, p.notify, word, value,
                                          q);
               });
  }
  c10::intrusive_ptr<c10d::Work> fetch_add(int rank, int64_t offset, int64_t value) {
    if (_t.scalar_type() != at::kLong) throw std::invalid_argument("hcomm: fetch_add needs an int64 window");
    const Peer& p = peer(rank);
    const uint64_t off = byte_offset(p, offset, 1, "fetch_add");
    at::Tensor old = at::zeros({1}, at::kLong);
    hcomm_request_t* q = nullptr;
    check(hcomm_ifetch_add(_world->ctx(), p.data, off, static_cast<uint64_t>(value),
                           reinterpret_cast<uint64_t*>(old.data_ptr()), &q),
          "fetch_add on rank " + std::to_string(rank));
    return c10::make_intrusive<HcommWork>(_world, c10d::OpType::UNKNOWN, "fetch_add on rank " + std::to_string(rank),
                                          std::vector<hcomm_request_t*>{q}, _pg->timeout(), std::vector<at::Tensor>{old});
  }
  void flush(int rank, int timeout_ms) {
    const int peer_rank = rank < 0 ? -1 : _pg->world_rank(rank);
    py::gil_scoped_release nogil;
    check(hcomm_flush(_world->ctx(), peer_rank, timeout_ms), "flush");
  }
  void notify_wait(int source, uint64_t value, int timeout_ms) {
    if (source < 0 || source >= _pg->getSize())
      throw std::out_of_range("hcomm: notify_wait: rank " + std::to_string(source) + " of " +
                              std::to_string(_pg->getSize()));
    py::gil_scoped_release nogil;
    check(hcomm_notify_wait(_world->ctx(), _notify, 8 * static_cast<uint64_t>(source), value, timeout_ms),
          "notify_wait for rank " + std::to_string(source));
  }
  uint64_t notify_value(int source) const {
    if (source < 0 || source >= _pg->getSize()) throw std::out_of_range("hcomm: notify_value: no such rank");
    return __atomic_load_n(static_cast<uint64_t*>(hcomm_mem_ptr(_notify)) + source, __ATOMIC_ACQUIRE);
  }
  at::Tensor tensor() const { return _t; }

  void free() {
    if (_world == nullptr) return;
    for (Peer& p : _peers) {
      (void)hcomm_rkey_release(p.data);
      (void)hcomm_rkey_release(p.notify);
    }
    _peers.clear();
    if (_notify != nullptr) (void)hcomm_mem_release(_notify);
    _notify = nullptr;
    if (_owned) {
      _world->remove_registration(_mem);
      (void)hcomm_mem_release(_mem);
    }
    _mem = nullptr;
    _world.reset();
  }

 private:
  struct Peer {
    uint64_t base = 0, bytes = 0;
    hcomm_rkey_t* data = nullptr;
    hcomm_rkey_t* notify = nullptr;
  };
  const Peer& peer(int rank) const {
    if (_world == nullptr) throw std::runtime_error("hcomm: the window was freed");
    if (_peers.empty()) throw std::runtime_error("hcomm: the window is not connected");
    if (rank < 0 || rank >= static_cast<int>(_peers.size()))
      throw std::out_of_range("hcomm: rank " + std::to_string(rank) + " is not in the window's group of " +
                              std::to_string(_peers.size()));
    return _peers[static_cast<size_t>(rank)];
  }
  uint64_t byte_offset(const Peer& p, int64_t offset, int64_t count, const char* what) const {
    const int64_t es = static_cast<int64_t>(_t.element_size());
    const int64_t elems = static_cast<int64_t>(p.bytes) / es;
    if (offset < 0 || count < 0 || offset > elems || count > elems - offset)
      throw std::out_of_range(std::string("hcomm: ") + what + ": elements [" + std::to_string(offset) + ", " +
                              std::to_string(offset + count) + ") outside the target's window of " +
                              std::to_string(elems));
    return p.base + static_cast<uint64_t>(offset * es);
  }
  // local: what the operation reads (put, accumulate) or writes (get:
  // into_local). It is reached through a registration: one this module made,
  // else a temporary one; where the engine cannot register it (the NPU engine
  // over vfio-user), the bytes are staged through hcomm memory (one copy).
  template <typename Post>
  c10::intrusive_ptr<c10d::Work> rma(const char* what, const at::Tensor& local, int rank, int64_t offset, Post post,
                                     bool into_local = false) {
    check_tensor(local, what);
    if (local.scalar_type() != _t.scalar_type())
      throw std::invalid_argument(std::string("hcomm: ") + what + ": a " + c10::toString(local.scalar_type()) +
                                  " tensor for a " + c10::toString(_t.scalar_type()) + " window");
    const Peer& p = peer(rank);
    const uint64_t off = byte_offset(p, offset, local.numel(), what);
    const std::string label = std::string(what) + " on rank " + std::to_string(rank);
    if (local.nbytes() == 0)
      return c10::make_intrusive<HcommWork>(_world, c10d::OpType::UNKNOWN, label, std::vector<hcomm_request_t*>{},
                                            _pg->timeout());
    std::vector<hcomm_mem_t*> temp;
    at::Tensor through = local;  // what hcomm reads or writes
    if (_world->find_registration(local.data_ptr(), local.nbytes()) == nullptr) {
      hcomm_mem_t* m = nullptr;
      hcomm_status_t st = hcomm_mem_register(_world->ctx(), local.data_ptr(), local.nbytes(), HCOMM_ACCESS_ALL, &m);
      if (st == HCOMM_ERR_UNSUPPORTED) {
        check(hcomm_mem_alloc(_world->ctx(), local.nbytes(), HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &m),
              label + ": staging memory");
        through = at::from_blob(hcomm_mem_ptr(m), local.sizes(), local.options());
        if (!into_local) through.copy_(local);
      } else {
        check(st, label + ": registering the local tensor");
      }
      temp.push_back(m);
    }
    hcomm_request_t* q = nullptr;
    hcomm_status_t st = post(p, off, through, &q);
    if (st != HCOMM_OK) {
      for (hcomm_mem_t* m : temp) (void)hcomm_mem_release(m);
      raise(st, label);
    }
    auto w = c10::make_intrusive<HcommWork>(_world, c10d::OpType::UNKNOWN, label, std::vector<hcomm_request_t*>{q},
                                            _pg->timeout(), std::vector<at::Tensor>{local});
    w->temp_regs = std::move(temp);
    if (into_local && !through.is_same(local)) {
      at::Tensor dst = local;
      w->on_done = [dst, through]() mutable { dst.copy_(through); };
    }
    return w;
  }

  c10::intrusive_ptr<ProcessGroupHcomm> _pg;
  std::shared_ptr<World> _world;
  at::Tensor _t;
  hcomm_mem_t* _mem = nullptr;
  bool _owned = false;
  uint64_t _base = 0;
  hcomm_mem_t* _notify = nullptr;
  std::vector<Peer> _peers;
};

// A tensor in hcomm memory (shareable with peers; what Window needs on an
// engine that cannot register a tensor's own memory).
at::Tensor empty(const c10::intrusive_ptr<ProcessGroupHcomm>& pg, const std::vector<int64_t>& sizes,
                 const at::Tensor& like) {  // like: an empty tensor of the dtype wanted
  const at::ScalarType dtype = like.scalar_type();
  std::shared_ptr<World> w = pg->world();
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (s < 0) throw std::invalid_argument("hcomm: empty: negative size");
    n *= s;
  }
  const size_t bytes = std::max<size_t>(static_cast<size_t>(n) * c10::elementSize(dtype), 1);
  hcomm_mem_t* m = nullptr;
  check(hcomm_mem_alloc(w->ctx(), bytes, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &m), "empty");
  void* p = hcomm_mem_ptr(m);
  w->add_registration(m, p, bytes);
  return at::from_blob(
      p, sizes,
      [w, m](void*) {
        w->remove_registration(m);
        (void)hcomm_mem_release(m);
      },
      at::TensorOptions().dtype(dtype));
}

}  // namespace
}  // namespace hcomm::torch_backend

PYBIND11_MODULE(_C, m) {
  using namespace hcomm::torch_backend;
  py::module_::import("torch.distributed");  // registers the c10d types this module builds on
  m.doc() = "hcomm's torch.distributed backend and tensor windows";
  m.attr("api_version") = hcomm_api_version();

  py::class_<ProcessGroupHcomm, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupHcomm>>(m, "ProcessGroupHcomm")
      .def_property_readonly("world_ranks", [](const ProcessGroupHcomm& pg) {
        std::vector<int> r;
        for (int i = 0; i < pg.getSize(); ++i) r.push_back(pg.world_rank(i));
        return r;
      })
      .def("peer_transport", [](const ProcessGroupHcomm& pg, int rank) {
        const char* t = hcomm_peer_transport(pg.world()->ctx(), pg.world_rank(rank));
        return std::string(t != nullptr ? t : "");
      })
      .def("engine", [](const ProcessGroupHcomm& pg) { return std::string(hcomm_engine_name(pg.world()->ctx())); });

  m.def(
      "create_process_group",
      [](const c10d::DistributedBackendOptions& o) {
        const auto ms = std::chrono::duration_cast<Ms>(o.timeout);
        return create_process_group(o.store, o.group_rank, o.group_size, o.global_ranks_in_group, o.group_id,
                                    ms.count() > 0 ? ms : Ms(1800000));
      },
      py::call_guard<py::gil_scoped_release>());

  py::class_<Window>(m, "Window")
      .def(py::init<const c10::intrusive_ptr<ProcessGroupHcomm>&, const at::Tensor&>())
      .def("keys", &Window::keys)
      .def("connect", &Window::connect)
      .def("put", &Window::put, py::call_guard<py::gil_scoped_release>())
      .def("get", &Window::get, py::call_guard<py::gil_scoped_release>())
      .def("accumulate", &Window::accumulate, py::call_guard<py::gil_scoped_release>())
      .def("put_notify", &Window::put_notify, py::call_guard<py::gil_scoped_release>())
      .def("fetch_add", &Window::fetch_add, py::call_guard<py::gil_scoped_release>())
      .def("flush", &Window::flush)
      .def("notify_wait", &Window::notify_wait)
      .def("notify_value", &Window::notify_value)
      .def("tensor", &Window::tensor)
      .def("free", &Window::free);

  m.def("empty", &empty);
}
