// hcomm-probe: the first tool an operator runs.
//
//   hcomm-probe [--json] [--sim-dir DIR] list
//   hcomm-probe [--json] [--sim-dir DIR] info DEV
//   hcomm-probe [--json] [--sim-dir DIR] selftest DEV
//   hcomm-probe [--json] rdma
//
// DEV is sim:N (a simulated NPU) or a PCI address bound to vfio-pci. `rdma`
// (built when libibverbs was found) lists the RDMA devices the verbs
// transport could use: per port its state, link layer, MTU, max message size
// and GID table, the port and GID hcomm would pick (HCOMM_IB_DEVICE,
// HCOMM_IB_PORT, HCOMM_IB_GID honoured), RLIMIT_MEMLOCK and rdma-core's fork
// status; no device is not an error.
// Exit status: 0 success, 1 a check failed or the device could not be
// opened, 2 usage error.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/barrier.h"
#include "common/env.h"
#include "common/paths.h"
#include "common/time.h"
#include "driver/discover.h"
#include "driver/dma_memory.h"
#include "driver/pci.h"
#include "hal/npu/device.h"
#include "hal/npu/dma_queue.h"
#include "hal/npu/rdma_qp.h"
#include "hal/abi/roce.h"
#include "hcomm_config.h"
#include "tools/options.h"

#if HCOMM_HAVE_IBVERBS
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <sys/resource.h>

#include "api/transport/verbs/gid_rule.h"
namespace gid_rule = hcomm::api::gid_rule;
#endif

using namespace hcomm;
namespace abi = hcomm::hal::abi;
namespace npu = hcomm::hal::npu;

namespace {

// ---- a small JSON writer (objects, arrays, strings, numbers, bools) ----
std::string jstr(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += static_cast<char>(c);
    else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += static_cast<char>(c);
  }
  return o + "\"";
}
struct JObj {
  std::string body;
  JObj& raw(const std::string& k, const std::string& v) {
    if (!body.empty()) body += ",";
    body += jstr(k) + ":" + v;
    return *this;
  }
  JObj& str(const std::string& k, const std::string& v) { return raw(k, jstr(v)); }
  JObj& num(const std::string& k, uint64_t v) { return raw(k, std::to_string(v)); }
  JObj& inum(const std::string& k, int64_t v) { return raw(k, std::to_string(v)); }
  JObj& boolean(const std::string& k, bool v) { return raw(k, v ? "true" : "false"); }
  std::string done() const { return "{" + body + "}"; }
};
std::string jarr(const std::vector<std::string>& items) {
  std::string o = "[";
  for (size_t i = 0; i < items.size(); ++i) o += (i ? "," : "") + items[i];
  return o + "]";
}
std::string hex(uint64_t v, int w = 4) {
  char b[32];
  std::snprintf(b, sizeof b, "%0*" PRIx64, w, v);
  return b;
}

struct Opts {
  bool json = false;
  std::string sim_dir = default_sim_dir();
};

std::string caps_string(uint64_t caps) {
  static const std::pair<uint64_t, const char*> names[] = {
      {abi::cap::COPY, "copy"},         {abi::cap::FILL, "fill"},   {abi::cap::REDUCE, "reduce"},
      {abi::cap::NOTIFY, "notify"},     {abi::cap::FP16, "fp16"},   {abi::cap::BF16, "bf16"},
      {abi::cap::PEER_DMA, "peer_dma"}, {abi::cap::MSIX, "msix"},   {abi::cap::WAKE_SUPPRESS, "wake_suppress"},
      {abi::cap::ATOMIC, "atomic"},     {abi::cap::ATT_SPAN, "att_span"}, {abi::cap::ROCE, "roce"}};
  std::string s;
  for (auto& [bit, n] : names)
    if (caps & bit) {  // (not `"," + std::string(n)`: GCC 12 -O3 warns -Wrestrict on it)
      if (!s.empty()) s += ',';
      s += n;
    }
  return s;
}

const char* kNoDeviceHint =
    "no hcomm device found.\n"
    "  Start the simulator:   hcomm-sim --devices 2 --hbm 256M &   (sockets in %s)\n"
    "  or bind an NPU:        echo vfio-pci > /sys/bus/pci/devices/ADDR/driver_override\n";

Status open_device(const Opts& o, const std::string& name, std::unique_ptr<npu::Device>* dev) {
  driver::DeviceRef ref;
  HCOMM_TRY(driver::parse_device_name(name, o.sim_dir, &ref));
  std::unique_ptr<driver::Link> link;
  Status st = driver::open_link(ref, &link, 3000);
  if (!st) {
    if (ref.kind == driver::DeviceRef::Kind::sim && driver::list_sim_devices(o.sim_dir).empty())
      std::fprintf(stderr, kNoDeviceHint, o.sim_dir.c_str());
    return st;
  }
  return npu::Device::open(std::move(link), dev);
}

// ---- list ----
int cmd_list(const Opts& o) {
  std::vector<std::string> jsim, jpci;
  auto sims = driver::list_sim_devices(o.sim_dir);
  size_t found = 0;
  if (!o.json) std::printf("simulated devices (%s):\n", o.sim_dir.c_str());
  for (unsigned i : sims) {
    std::string name = "sim:" + std::to_string(i);
    std::unique_ptr<npu::Device> dev;
    Status st = open_device(o, name, &dev);
    JObj j;
    j.str("name", name).str("socket", sim_socket_path(o.sim_dir, i)).str("link", "vfio-user");
    if (st) {
      ++found;
      const auto& in = dev->info();
      j.str("id", hex(in.vendor_id) + ":" + hex(in.device_id)).num("hbm_bytes", in.hbm_size)
          .num("queues", in.num_queues).num("fabric_index", in.fabric_index).boolean("ok", true);
      if (!o.json)
        std::printf("  %-8s %s:%s  vfio-user  HBM %" PRIu64 " MiB  %u queues  fabric %u/%u\n", name.c_str(),
                    hex(in.vendor_id).c_str(), hex(in.device_id).c_str(), in.hbm_size >> 20, in.num_queues,
                    in.fabric_index, in.fabric_size);
    } else {
      j.boolean("ok", false).str("error", st.to_string());
      if (!o.json) std::printf("  %-8s unreachable: %s\n", name.c_str(), st.to_string().c_str());
    }
    jsim.push_back(j.done());
  }
  if (!o.json && sims.empty()) std::printf("  (none)\n");

  driver::PciScanner scanner;
  std::vector<driver::PciFunction> fns;
  Status pst = scanner.scan(&fns);
  if (!o.json) std::printf("PCI functions (NPUs, ivshmem, vfio-pci bound):\n");
  size_t shown = 0;
  for (const auto& f : fns) {
    if (!f.is_hcomm_npu() && !f.is_ivshmem() && f.driver != "vfio-pci") continue;
    ++shown;
    if (f.is_hcomm_npu()) ++found;
    JObj j;
    std::vector<std::string> bars;
    std::string bartxt;
    for (size_t b = 0; b < f.bars.size(); ++b) {
      if (!f.bars[b].present()) continue;
      bars.push_back(JObj().num("bar", b).num("size", f.bars[b].size).done());
      bartxt += " BAR" + std::to_string(b) + "=" + std::to_string(f.bars[b].size);
    }
    j.str("address", f.address).str("id", hex(f.vendor) + ":" + hex(f.device)).str("class", hex(f.class_code, 6))
        .str("driver", f.driver).inum("iommu_group", f.iommu_group).inum("numa_node", f.numa_node)
        .boolean("hcomm_npu", f.is_hcomm_npu()).boolean("ivshmem", f.is_ivshmem()).raw("bars", jarr(bars));
    // An ivshmem function bound to vfio-pci may be hcomm-sim's QEMU front:
    // open it to find out (the link refuses foreign ivshmem memory).
    std::string behind;
    if (f.is_ivshmem() && f.driver == "vfio-pci") {
      std::unique_ptr<npu::Device> dev;
      if (Status st = open_device(o, f.address, &dev); st) {
        ++found;
        const auto& in = dev->info();
        j.boolean("npu_behind_ivshmem", true).num("hbm_bytes", in.hbm_size).num("queues", in.num_queues)
            .num("fabric_index", in.fabric_index);
        behind = " [hcomm NPU via ivshmem: HBM " + std::to_string(in.hbm_size >> 20) + " MiB, " +
                 std::to_string(in.num_queues) + " queues, fabric " + std::to_string(in.fabric_index) + "/" +
                 std::to_string(in.fabric_size) + "]";
      } else {
        j.boolean("npu_behind_ivshmem", false).str("error", st.to_string());
        behind = " [ivshmem: " + st.to_string() + "]";
      }
    } else if (f.is_ivshmem()) {
      behind = " [ivshmem: bind it to vfio-pci to use it]";
    }
    jpci.push_back(j.done());
    if (!o.json)
      std::printf("  %s %s:%s class %s driver %s iommu_group %d numa %d%s%s\n", f.address.c_str(),
                  hex(f.vendor).c_str(), hex(f.device).c_str(), hex(f.class_code, 6).c_str(),
                  f.driver.empty() ? "(none)" : f.driver.c_str(), f.iommu_group, f.numa_node, bartxt.c_str(),
                  f.is_hcomm_npu() ? " [hcomm NPU]" : behind.c_str());
  }
  if (!o.json && shown == 0) std::printf("  (none)%s\n", pst ? "" : (" - " + pst.to_string()).c_str());
  if (o.json) {
    std::printf("%s\n", JObj().raw("simulated", jarr(jsim)).raw("pci", jarr(jpci)).num("devices", found).done().c_str());
  } else if (found == 0) {
    std::fprintf(stderr, kNoDeviceHint, o.sim_dir.c_str());
  }
  return found == 0 ? 1 : 0;
}

// ---- info ----
int cmd_info(const Opts& o, const std::string& name) {
  std::unique_ptr<npu::Device> dev;
  if (Status st = open_device(o, name, &dev); !st) {
    std::fprintf(stderr, "hcomm-probe: %s: %s\n", name.c_str(), st.to_string().c_str());
    return 1;
  }
  const auto& in = dev->info();
  npu::ErrorLog el;
  Status est = dev->error_log(&el);
  // The network engine (cap::ROCE): the port, its counters, the QPs in use.
  npu::NetInfo net;
  const bool has_net = (in.caps & abi::cap::ROCE) != 0 && dev->net_info(&net).is_ok();
  std::vector<std::pair<uint32_t, abi::rdma::QpState>> qps;
  if (has_net) {
    for (uint32_t s = 0; s < net.num_qp; ++s) {
      uint32_t qpn = abi::rdma::kQpnBase + s, st = 0;
      if (dev->net_command(abi::net_cmd::QP_QUERY, &qpn, 4, &st).is_ok())
        qps.emplace_back(qpn, static_cast<abi::rdma::QpState>(st));
    }
  }
  static const char* const kCounterNames[abi::reg::kNetCounterCount] = {
      "tx_frames", "rx_frames", "rx_bad_icrc", "rx_malformed", "rx_not_roce", "rx_unsupported", "rx_no_qp",
      "retransmits", "timeouts", "seq_naks_sent", "seq_naks_rcvd", "rnr_naks_sent", "rnr_naks_rcvd", "duplicates",
      "access_naks_sent", "arp_replies"};
  static const char* const kQpStates[] = {"RESET", "INIT", "RTR", "RTS", "ERR"};
  if (o.json) {
    JObj j;
    j.str("name", name).str("link", dev->link().kind()).str("location", dev->link().location())
        .str("id", hex(in.vendor_id) + ":" + hex(in.device_id))
        .str("abi_version", std::to_string(in.abi_version >> 16) + "." + std::to_string(in.abi_version & 0xffff))
        .str("caps", caps_string(in.caps)).num("hbm_bytes", in.hbm_size).num("queues", in.num_queues)
        .num("max_queue_entries", 1ull << in.max_queue_log2).num("att_entries", in.num_att)
        .num("msix_vectors", in.num_msix).num("fabric_index", in.fabric_index).num("fabric_size", in.fabric_size)
        .boolean("hbm_mapped", dev->hbm() != nullptr);
    if (est) j.num("errors", el.count).num("last_error_code", el.last_code).num("completed", el.completed);
    if (has_net) {
      j.str("port_mac", hal::abi::roce::mac_string(net.mac)).str("port_ip", hal::abi::roce::ip_string(net.ip))
          .boolean("port_link_up", net.link_up).num("port_max_mtu", net.max_mtu).num("port_qp_slots", net.num_qp)
          .num("port_keys", net.num_mr);
      for (uint32_t i = 0; i < abi::reg::kNetCounterCount; ++i) j.num(std::string("port_") + kCounterNames[i], net.counters[i]);
      std::vector<std::string> jq;
      for (auto& [qpn, st] : qps) jq.push_back(jstr(std::to_string(qpn) + " " + kQpStates[static_cast<int>(st) % 5]));
      j.raw("qps", jarr(jq));
    }
    std::printf("%s\n", j.done().c_str());
  } else {
    std::printf("%s (%s %s)\n", name.c_str(), dev->link().kind(), dev->link().location().c_str());
    std::printf("  id           %s:%s\n", hex(in.vendor_id).c_str(), hex(in.device_id).c_str());
    std::printf("  ABI          %u.%u (driver built for %u.%u)\n", in.abi_version >> 16, in.abi_version & 0xffff,
                abi::kAbiMajor, abi::kAbiMinor);
    std::printf("  capabilities %s\n", caps_string(in.caps).c_str());
    std::printf("  HBM          %" PRIu64 " MiB%s\n", in.hbm_size >> 20, dev->hbm() ? " (BAR2 mapped)" : "");
    std::printf("  DMA queues   %u (up to %llu entries each), %u MSI-X vectors\n", in.num_queues,
                1ull << in.max_queue_log2, in.num_msix);
    std::printf("  ATT entries  %u\n", in.num_att);
    std::printf("  fabric       device %u of %u\n", in.fabric_index, in.fabric_size);
    if (est)
      std::printf("  errors       %" PRIu64 " (last code %u %s), %" PRIu64 " descriptors completed\n", el.count,
                  el.last_code, abi::cq_status_name(static_cast<abi::CqStatus>(el.last_code)), el.completed);
    if (has_net) {
      std::printf("  port         MAC %s, IPv4 %s (GID ::ffff:%s), link %s, MTU up to %u, %u QP slots, %u keys\n",
                  hal::abi::roce::mac_string(net.mac).c_str(), hal::abi::roce::ip_string(net.ip).c_str(),
                  hal::abi::roce::ip_string(net.ip).c_str(), net.link_up ? "up" : "down", net.max_mtu, net.num_qp,
                  net.num_mr);
      std::string c;
      for (uint32_t i = 0; i < abi::reg::kNetCounterCount; ++i)
        if (net.counters[i] != 0) c += std::string(c.empty() ? "" : ", ") + kCounterNames[i] + " " + std::to_string(net.counters[i]);
      std::printf("  counters     %s\n", c.empty() ? "all 0" : c.c_str());
      std::string q;
      for (auto& [qpn, st] : qps) q += std::string(q.empty() ? "" : ", ") + std::to_string(qpn) + " " + kQpStates[static_cast<int>(st) % 5];
      std::printf("  QPs          %s\n", q.empty() ? "none" : q.c_str());
    }
  }
  return 0;
}

// ---- selftest ----
struct Check {
  std::string name;
  bool pass;
  std::string detail;
};

class SelfTest {
 public:
  explicit SelfTest(npu::Device& dev) : _dev(dev) {}
  std::vector<Check> run();

 private:
  void check(const std::string& name, const std::function<std::string()>& body) {
    std::string err = body();
    _checks.push_back({name, err.empty(), err});
  }
  std::string registers();
  std::string setup();
  std::string copy_host_hbm();
  std::string fill_hbm();
  std::string reduce_fp32();
  std::string reduce_int32_max();
  std::string peer_hbm();
  std::string notify();
  std::string atomics();
  std::string ring_wrap();
  std::string expected_errors();
  std::string roce_loopback();
  std::string run_queue(npu::DmaQueue& q, abi::CqStatus* first = nullptr);

  npu::Device& _dev;
  std::vector<Check> _checks;
  std::unique_ptr<npu::DmaQueue> _q;
  driver::DmaBuffer _a, _b;
  npu::Mapping _ma, _mb, _mhbm;
  static constexpr uint64_t kLen = 256 * 1024;
};

std::string SelfTest::run_queue(npu::DmaQueue& q, abi::CqStatus* first) {
  abi::CqStatus e = abi::CqStatus::OK;
  Status st = q.drain(Deadline::after_ms(5000), &e);
  if (!st) return st.to_string();
  if (first != nullptr) {
    *first = e;
    return "";
  }
  return e == abi::CqStatus::OK ? "" : std::string("completion status ") + abi::cq_status_name(e);
}

std::string SelfTest::registers() {
  uint32_t v = 0;
  for (uint32_t pat : {0xa5a5a5a5u, 0x5a5a5a5au, 0u, 0xffffffffu}) {
    if (Status st = _dev.write32(abi::reg::SCRATCH, pat); !st) return st.to_string();
    if (Status st = _dev.read32(abi::reg::SCRATCH, &v); !st) return st.to_string();
    if (v != pat) return "SCRATCH wrote " + hex(pat, 8) + " read " + hex(v, 8);
  }
  uint32_t nq = 0;
  (void)_dev.read32(abi::reg::NUM_QUEUES, &nq);
  (void)_dev.write32(abi::reg::NUM_QUEUES, nq + 7);
  (void)_dev.read32(abi::reg::NUM_QUEUES, &v);
  if (v != nq) return "read-only NUM_QUEUES changed on write";
  (void)_dev.read32(abi::reg::STATUS, &v);
  if ((v & abi::status::READY) == 0 || (v & abi::status::ENABLED) == 0) return "STATUS " + hex(v, 8) + " not READY|ENABLED";
  return "";
}

std::string SelfTest::setup() {
  bool irq = (_dev.info().caps & abi::cap::MSIX) != 0;
  if (Status st = _dev.create_queue(6, irq, &_q); !st) return st.to_string();
  if (Status st = driver::DmaBuffer::allocate(kLen, -1, &_a); !st) return st.to_string();
  if (Status st = driver::DmaBuffer::allocate(kLen, -1, &_b); !st) return st.to_string();
  // Exactly kLen is mapped even where buffers are rounded up (hugepages in
  // iova-mode=pa): the error checks below aim just past it.
  if (Status st = _dev.map_host(_a.data(), kLen, _a.fd(), 0, npu::access::RW, &_ma); !st) return st.to_string();
  if (Status st = _dev.map_host(_b.data(), kLen, _b.fd(), 0, npu::access::RW, &_mb); !st) return st.to_string();
  if (_dev.info().hbm_size < 2 * kLen) return "HBM smaller than the test needs";
  if (Status st = _dev.map_hbm(0, 2 * kLen, npu::access::RW, &_mhbm); !st) return st.to_string();
  return "";
}

std::string SelfTest::copy_host_hbm() {
  auto* a = static_cast<uint8_t*>(_a.data());
  auto* b = static_cast<uint8_t*>(_b.data());
  for (uint64_t i = 0; i < kLen; ++i) a[i] = static_cast<uint8_t>(i * 131 + 7);
  std::memset(b, 0, kLen);
  if (_q->copy(_ma.iova, _mhbm.iova, kLen, 1) != Code::ok) return "enqueue failed";
  if (_q->copy(_mhbm.iova, _mb.iova, kLen, 2, abi::desc_flag::FENCE) != Code::ok) return "enqueue failed";
  if (auto e = run_queue(*_q); !e.empty()) return e;
  if (std::memcmp(a, b, kLen) != 0) return "host->HBM->host data mismatch";
  if (_dev.hbm() != nullptr && std::memcmp(_dev.hbm(), a, kLen) != 0) return "HBM (BAR2 view) mismatch";
  return "";
}

std::string SelfTest::fill_hbm() {
  const uint64_t pat = 0x0123456789abcdefull;
  const uint64_t len = 4096 + 5;  // a partial pattern at the tail
  if (_q->fill(_mhbm.iova + kLen, len, pat, 3) != Code::ok) return "enqueue failed";
  if (_q->copy(_mhbm.iova + kLen, _mb.iova, len, 4, abi::desc_flag::FENCE) != Code::ok) return "enqueue failed";
  if (auto e = run_queue(*_q); !e.empty()) return e;
  auto* b = static_cast<uint8_t*>(_b.data());
  uint8_t p[8];
  std::memcpy(p, &pat, 8);
  for (uint64_t i = 0; i < len; ++i)
    if (b[i] != p[i % 8]) return "byte " + std::to_string(i) + " not the fill pattern";
  return "";
}

std::string SelfTest::reduce_fp32() {
  const uint64_t n = 4096;
  auto* a = static_cast<float*>(_a.data());
  auto* b = static_cast<float*>(_b.data());
  for (uint64_t i = 0; i < n; ++i) a[i] = static_cast<float>(i) * 0.5f, b[i] = 1.0f + static_cast<float>(i % 7);
  // dst (in HBM) = b; dst += a; back to host.
  if (_q->copy(_mb.iova, _mhbm.iova, n * 4, 5) != Code::ok) return "enqueue failed";
  if (_q->reduce(_ma.iova, _mhbm.iova, n * 4, abi::DType::FP32, abi::RedOp::SUM, 6, abi::desc_flag::FENCE) != Code::ok)
    return "enqueue failed";
  if (_q->copy(_mhbm.iova, _mb.iova, n * 4, 7, abi::desc_flag::FENCE) != Code::ok) return "enqueue failed";
  if (auto e = run_queue(*_q); !e.empty()) return e;
  for (uint64_t i = 0; i < n; ++i) {
    float want = static_cast<float>(i) * 0.5f + 1.0f + static_cast<float>(i % 7);
    if (b[i] != want) return "element " + std::to_string(i) + " = " + std::to_string(b[i]) + ", want " + std::to_string(want);
  }
  return "";
}

std::string SelfTest::reduce_int32_max() {
  const uint64_t n = 1024;
  auto* a = static_cast<int32_t*>(_a.data());
  auto* b = static_cast<int32_t*>(_b.data());
  for (uint64_t i = 0; i < n; ++i) a[i] = static_cast<int32_t>(i) - 512, b[i] = static_cast<int32_t>(511 - i);
  if (_q->reduce(_ma.iova, _mb.iova, n * 4, abi::DType::INT32, abi::RedOp::MAX, 8) != Code::ok) return "enqueue failed";
  if (auto e = run_queue(*_q); !e.empty()) return e;
  for (uint64_t i = 0; i < n; ++i) {
    int32_t want = std::max(static_cast<int32_t>(i) - 512, static_cast<int32_t>(511 - i));
    if (b[i] != want) return "element " + std::to_string(i) + " wrong";
  }
  return "";
}

std::string SelfTest::peer_hbm() {
  const auto& in = _dev.info();
  if (in.fabric_size < 2) return "";  // nothing to test on a single-device node
  uint32_t peer = (in.fabric_index + 1) % in.fabric_size;
  npu::Mapping mp;
  // The top 64 KiB of the peer's HBM: scratch space the selftest may overwrite.
  const uint64_t len = 64 * 1024;
  if (Status st = _dev.map_peer_hbm(peer, in.hbm_size - len, len, npu::access::RW, &mp); !st) return st.to_string();
  auto* a = static_cast<uint8_t*>(_a.data());
  auto* b = static_cast<uint8_t*>(_b.data());
  for (uint64_t i = 0; i < len; ++i) a[i] = static_cast<uint8_t>(i ^ 0x3c);
  std::memset(b, 0, len);
  std::string err;
  if (_q->copy(_ma.iova, mp.iova, len, 9) != Code::ok ||
      _q->copy(mp.iova, _mhbm.iova, len, 10, abi::desc_flag::FENCE) != Code::ok ||
      _q->copy(_mhbm.iova, _mb.iova, len, 11, abi::desc_flag::FENCE) != Code::ok)
    err = "enqueue failed";
  if (err.empty()) err = run_queue(*_q);
  if (err.empty() && std::memcmp(a, b, len) != 0) err = "host->peer HBM->HBM->host mismatch";
  if (Status st = _dev.unmap(&mp); !st && err.empty()) err = st.to_string();
  return err.empty() ? "" : err + " (peer " + std::to_string(peer) + ")";
}

std::string SelfTest::notify() {
  auto* flag = reinterpret_cast<volatile uint64_t*>(static_cast<uint8_t*>(_b.data()) + kLen - 64);
  *flag = 0;
  if (_q->copy(_ma.iova, _mhbm.iova, kLen, 12) != Code::ok) return "enqueue failed";
  if (_q->notify(_mb.iova + kLen - 64, 0xfeedf00dull, 13) != Code::ok) return "enqueue failed";
  if (auto e = run_queue(*_q); !e.empty()) return e;
  if (*flag != 0xfeedf00dull) return "notify value not written";
  return "";
}

std::string SelfTest::atomics() {
  if ((_dev.info().caps & abi::cap::ATOMIC) == 0) return "";
  auto* w = reinterpret_cast<volatile uint64_t*>(static_cast<uint8_t*>(_a.data()));
  auto* res = reinterpret_cast<volatile uint64_t*>(static_cast<uint8_t*>(_b.data()));
  *w = 40;
  if (_q->fetch_add(_ma.iova, _mb.iova, 2, 14) != Code::ok) return "enqueue failed";
  if (_q->cmp_swap(_ma.iova, _mb.iova + 8, 42, 100, 15) != Code::ok) return "enqueue failed";
  if (auto e = run_queue(*_q); !e.empty()) return e;
  if (res[0] != 40 || res[1] != 42 || *w != 100) return "fetch_add/cmp_swap results wrong";
  return "";
}

std::string SelfTest::ring_wrap() {
  std::unique_ptr<npu::DmaQueue> q;
  if (Status st = _dev.create_queue(3, false, &q); !st) return st.to_string();
  const uint32_t total = 4096;  // 512 wraps of an 8-entry ring
  uint32_t sent = 0, done = 0, expect_index = 0;
  npu::Completion c[8];
  Deadline dl = Deadline::after_ms(10000);
  auto* a = static_cast<uint8_t*>(_a.data());
  auto* b = static_cast<uint8_t*>(_b.data());
  for (uint32_t i = 0; i < 64; ++i) a[i] = static_cast<uint8_t>(i);
  while (done < total) {
    while (sent < total && q->copy(_ma.iova + (sent % 64), _mb.iova + (sent % 64), 1, sent) == Code::ok) ++sent;
    q->submit();
    if (q->wait(dl) != Code::ok) return "timeout after " + std::to_string(done) + " completions";
    uint32_t n = q->poll(c);
    for (uint32_t i = 0; i < n; ++i, ++done) {
      if (c[i].status != abi::CqStatus::OK) return std::string("status ") + abi::cq_status_name(c[i].status);
      if (c[i].index != expect_index++ || c[i].user_data != done) return "completion out of order";
    }
  }
  for (uint32_t i = 0; i < 64; ++i)
    if (b[i] != a[i]) return "byte copy mismatch";
  return "";
}

std::string SelfTest::expected_errors() {
  npu::ErrorLog before, after;
  if (Status st = _dev.error_log(&before); !st) return st.to_string();
  struct Case {
    const char* what;
    std::function<Code()> enq;
    abi::CqStatus want;
  };
  const uint64_t unmapped = 0x10;  // the HAL never hands out IOVAs this low
  Case cases[] = {
      {"copy from unmapped IOVA", [&] { return _q->copy(unmapped, _mb.iova, 64, 20); }, abi::CqStatus::SRC_FAULT},
      {"copy past the end of a mapping", [&] { return _q->copy(_ma.iova, _mb.iova + kLen - 8, 64, 21); },
       abi::CqStatus::DST_FAULT},
      {"zero-length copy", [&] { return _q->copy(_ma.iova, _mb.iova, 0, 22); }, abi::CqStatus::BAD_LENGTH},
      {"misaligned fp32 reduce", [&] { return _q->reduce(_ma.iova + 2, _mb.iova, 64, abi::DType::FP32, abi::RedOp::SUM, 23); },
       abi::CqStatus::BAD_ALIGN},
      {"unknown opcode", [&] { abi::SqEntry e{}; e.opcode = 0x7f; return _q->enqueue(e); }, abi::CqStatus::BAD_OPCODE},
  };
  for (auto& c : cases) {
    if (c.enq() != Code::ok) return std::string(c.what) + ": enqueue failed";
    abi::CqStatus got;
    if (auto e = run_queue(*_q, &got); !e.empty()) return e;
    if (got != c.want)
      return std::string(c.what) + ": got " + abi::cq_status_name(got) + ", want " + abi::cq_status_name(c.want);
  }
  if (Status st = _dev.error_log(&after); !st) return st.to_string();
  if (after.count < before.count + 5) return "ERR_COUNT did not count the errors";
  // The queue keeps working after errors.
  if (_q->copy(_ma.iova, _mb.iova, 64, 30) != Code::ok) return "enqueue after errors failed";
  if (auto e = run_queue(*_q); !e.empty()) return "after errors: " + e;
  return "";
}

// Two queue pairs on this device's port, connected to each other: the
// frames leave the port and come back (the simulator's switch, or a port in
// loopback). WRITE host -> HBM, READ HBM -> host, FETCH_ADD on HBM.
std::string SelfTest::roce_loopback() {
  namespace rdma = abi::rdma;
  npu::NetInfo net;
  if (Status st = _dev.net_info(&net); !st) return st.to_string();
  if (!net.link_up) return "link down";
  uint32_t khost = 0, khbm = 0;
  if (Status st = _dev.mr_register(_ma.iova, kLen, rdma::access::ALL, &khost); !st) return st.to_string();
  if (Status st = _dev.mr_register(_mhbm.iova, 2 * kLen, rdma::access::ALL, &khbm); !st) {
    (void)_dev.mr_invalidate(khost);
    return st.to_string();
  }
  std::string err;
  {
    npu::QpOptions o;
    o.timeout = 14;
    std::unique_ptr<npu::RdmaQp> a, b;
    Status st = _dev.create_qp(o, &a);
    if (st) st = _dev.create_qp(o, &b);
    npu::QpPeer pa{b ? b->qpn() : 0, net.ip, {}, 0}, pb{a ? a->qpn() : 0, net.ip, {}, 0};
    std::memcpy(pa.mac, net.mac, 6);
    std::memcpy(pb.mac, net.mac, 6);
    if (st) st = a->connect(pa);
    if (st) st = b->connect(pb);
    if (!st) err = st.to_string();
    auto* host = static_cast<uint8_t*>(_a.data());
    for (uint64_t i = 0; i < 8192; ++i) host[i] = static_cast<uint8_t>(i * 7 + (i >> 8) + 3);
    std::memset(host + 0x4000, 0, 8192);  // the READ lands here
    uint64_t word = 40;
    std::memcpy(host + 0x8000, &word, 8);
    auto w = [&](rdma::WrOp op, uint64_t l, uint32_t lk, uint32_t len, uint64_t r, uint32_t rk, uint64_t id) {
      rdma::SendWqe x = rdma::make_wqe(op, l, lk, len, r, rk, id);
      x.swap_add = 2;
      return x;
    };
    // host[0, 8K) -> HBM[kLen, +8K); HBM[kLen, +8K) -> host[16K, +8K); fetch_add on host word 0x8000.
    if (err.empty() && (a->post_send(w(rdma::WrOp::WRITE, _ma.iova, khost, 8192, _mhbm.iova + kLen, khbm, 1)) != Code::ok ||
                        a->post_send(w(rdma::WrOp::READ, _ma.iova + 0x4000, khost, 8192, _mhbm.iova + kLen, khbm, 2)) != Code::ok ||
                        a->post_send(w(rdma::WrOp::FETCH_ADD, _mhbm.iova + kLen + 0x4000, khbm, 8, _ma.iova + 0x8000, khost, 3)) != Code::ok))
      err = "posting failed";
    if (err.empty()) {
      rdma::Cqe c[3];
      if (Status ws = a->wait(3, c, Deadline::after_ms(5000)); !ws) {
        err = ws.to_string();
      } else {
        for (const auto& x : c)
          if (x.status != 0 && err.empty())
            err = "wr " + std::to_string(x.wr_id) + ": " + rdma::wc_status_name(static_cast<rdma::WcStatus>(x.status));
      }
    }
    if (err.empty()) {
      if (std::memcmp(host + 0x4000, host, 8192) != 0) err = "WRITE then READ through the port did not return the bytes";
      std::memcpy(&word, host + 0x8000, 8);
      if (err.empty() && word != 42) err = "FETCH_ADD left " + std::to_string(word) + ", want 42";
    }
  }
  (void)_dev.mr_invalidate(khost);
  (void)_dev.mr_invalidate(khbm);
  return err;
}

std::vector<Check> SelfTest::run() {
  check("registers", [&] { return registers(); });
  check("queue setup", [&] { return setup(); });
  if (!_checks.back().pass) return _checks;
  check("copy host->HBM->host", [&] { return copy_host_hbm(); });
  check("fill HBM", [&] { return fill_hbm(); });
  check("reduce fp32 sum (HBM)", [&] { return reduce_fp32(); });
  check("reduce int32 max (host)", [&] { return reduce_int32_max(); });
  if (_dev.info().fabric_size > 1) check("copy host->peer HBM->HBM", [&] { return peer_hbm(); });
  check("notify after copy", [&] { return notify(); });
  if (_dev.info().caps & abi::cap::ATOMIC) check("fetch_add / cmp_swap", [&] { return atomics(); });
  check("ring wrap (8 entries x 512)", [&] { return ring_wrap(); });
  check("expected errors", [&] { return expected_errors(); });
  if (_dev.info().caps & abi::cap::ROCE) check("RoCE loopback write/read/atomic through the port", [&] { return roce_loopback(); });
  for (npu::Mapping* m : {&_mhbm, &_mb, &_ma})
    if (m->valid()) (void)_dev.unmap(m);
  _q.reset();
  return _checks;
}

int cmd_selftest(const Opts& o, const std::string& name) {
  std::unique_ptr<npu::Device> dev;
  if (Status st = open_device(o, name, &dev); !st) {
    std::fprintf(stderr, "hcomm-probe: %s: %s\n", name.c_str(), st.to_string().c_str());
    return 1;
  }
  auto t0 = Clock::now();
  std::vector<Check> checks = SelfTest(*dev).run();
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  size_t failed = 0;
  for (auto& c : checks) failed += c.pass ? 0 : 1;
  if (o.json) {
    std::vector<std::string> items;
    for (auto& c : checks) items.push_back(JObj().str("name", c.name).boolean("pass", c.pass).str("detail", c.detail).done());
    std::printf("%s\n", JObj().str("device", name).boolean("pass", failed == 0).num("checks", checks.size())
                            .num("failed", failed).raw("results", jarr(items)).done().c_str());
  } else {
    std::printf("selftest %s (%s %s)\n", name.c_str(), dev->link().kind(), dev->link().location().c_str());
    for (auto& c : checks)
      std::printf("  [%s] %s%s%s\n", c.pass ? "PASS" : "FAIL", c.name.c_str(), c.pass ? "" : ": ", c.detail.c_str());
    std::printf("%zu checks, %zu failed, %.1f ms\n", checks.size(), failed, ms);
  }
  return failed == 0 ? 0 : 1;
}

#if HCOMM_HAVE_IBVERBS
// ---- rdma ----
std::string gid_addr(const ibv_gid& g, bool* v4) {
  char buf[INET6_ADDRSTRLEN] = "?";
  *v4 = gid_rule::ipv4_mapped(g.raw);
  ::inet_ntop(*v4 ? AF_INET : AF_INET6, *v4 ? g.raw + 12 : g.raw, buf, sizeof buf);
  return buf;
}

struct GidRow {
  gid_rule::Entry e;
  std::string type, addr, netdev;
};

// The GID the verbs transport picks (the rule of api/transport/verbs/gid_rule.h;
// on InfiniBand index 0 unless HCOMM_IB_GID is set): its position in rows, or -1.
int pick_gid(const std::vector<GidRow>& rows, bool ib, const char* force) {
  if (ib && force == nullptr) return rows.empty() || rows[0].e.index != 0 ? -1 : 0;
  std::vector<gid_rule::Entry> t;
  for (const GidRow& r : rows) t.push_back(r.e);
  return gid_rule::choose(t, force != nullptr ? force : "");
}

std::string limit_text(rlim_t v) { return v == RLIM_INFINITY ? "unlimited" : std::to_string(v / 1024) + " KiB"; }

int cmd_rdma(const Opts& o) {
  rlimit ml{};
  ::getrlimit(RLIMIT_MEMLOCK, &ml);
  const ibv_fork_status fs = ::ibv_is_fork_initialized();
  const char* fork = fs == IBV_FORK_UNNEEDED ? "unneeded" : fs == IBV_FORK_ENABLED ? "enabled" : "disabled";
  // As the transport reads them (common/env.h): set but empty is unset.
  const char* env_dev = hcomm::env("HCOMM_IB_DEVICE");
  const char* env_port = hcomm::env("HCOMM_IB_PORT");
  const char* env_gid = hcomm::env("HCOMM_IB_GID");
  std::string want_dev = env_dev != nullptr ? env_dev : "";
  int want_port = env_port != nullptr ? std::atoi(env_port) : 0;
  if (auto c = want_dev.find(':'); c != std::string::npos) want_port = std::atoi(want_dev.c_str() + c + 1), want_dev.resize(c);
  int n = 0;
  ibv_device** list = ::ibv_get_device_list(&n);
  bool chosen = false;  // the verbs transport takes the first active port that matches
  std::vector<std::string> jdevs;
  for (int d = 0; list != nullptr && d < n; ++d) {
    const std::string name = ::ibv_get_device_name(list[d]);
    JObj jd;
    jd.str("name", name);
    ibv_context* c = ::ibv_open_device(list[d]);
    ibv_device_attr da{};
    if (c == nullptr || ::ibv_query_device(c, &da) != 0) {
      jd.str("error", std::string("cannot open: ") + std::strerror(errno));
      if (!o.json) std::printf("%s: cannot open: %s\n", name.c_str(), std::strerror(errno));
      if (c != nullptr) ::ibv_close_device(c);
      jdevs.push_back(jd.done());
      continue;
    }
    if (!o.json) std::printf("%s: %u port(s), fw %s, max_qp %d, max_mr_size %" PRIu64 "\n", name.c_str(), da.phys_port_cnt,
                             da.fw_ver, da.max_qp, static_cast<uint64_t>(da.max_mr_size));
    jd.num("ports_count", da.phys_port_cnt).str("fw", da.fw_ver);
    std::vector<std::string> jports;
    for (uint8_t p = 1; p <= da.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (::ibv_query_port(c, p, &pa) != 0) continue;
      const bool ib = pa.link_layer == IBV_LINK_LAYER_INFINIBAND;
      const bool use = !chosen && pa.state == IBV_PORT_ACTIVE && (want_dev.empty() || want_dev == name) &&
                       (want_port == 0 || want_port == p);
      chosen |= use;
      std::vector<GidRow> rows;
      for (int i = 0; i < pa.gid_tbl_len; ++i) {
        ibv_gid_entry e{};
        if (::ibv_query_gid_ex(c, p, static_cast<uint32_t>(i), &e, 0) != 0) continue;
        bool zero = true, v4 = false;
        for (uint8_t b : e.gid.raw) zero &= b == 0;
        if (zero) continue;
        GidRow r;
        r.addr = gid_addr(e.gid, &v4);
        r.e.index = static_cast<uint32_t>(i);
        std::memcpy(r.e.raw, e.gid.raw, sizeof r.e.raw);
        r.e.roce_v2 = e.gid_type == IBV_GID_TYPE_ROCE_V2;
        char ifn[IF_NAMESIZE] = "";
        if (e.ndev_ifindex != 0 && ::if_indextoname(e.ndev_ifindex, ifn) != nullptr) r.netdev = ifn;
        r.type = r.e.roce_v2 ? (v4 ? "RoCEv2 IPv4" : "RoCEv2") : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? "RoCEv1" : "IB";
        rows.push_back(r);
      }
      const int pick = pick_gid(rows, ib, env_gid);
      const std::string mtu = std::to_string(128 << static_cast<int>(pa.active_mtu));
      if (!o.json) {
        std::printf("  port %u: %s, link %s, active MTU %s, max message %" PRIu32 " B%s\n", p,
                    ::ibv_port_state_str(pa.state), ib ? "InfiniBand" : "Ethernet", mtu.c_str(), pa.max_msg_sz,
                    use ? "  <- hcomm uses this port" : "");
        for (size_t i = 0; i < rows.size(); ++i)
          std::printf("    gid %-3u %-11s %-40s %s%s\n", rows[i].e.index, rows[i].type.c_str(), rows[i].addr.c_str(),
                      rows[i].netdev.c_str(), static_cast<int>(i) == pick ? "  <- hcomm's GID" : "");
        if (rows.empty()) std::printf("    (no GID)\n");
        if (pick < 0)
          std::printf("    no GID hcomm would use (%s)\n", env_gid != nullptr ? ("HCOMM_IB_GID=" + std::string(env_gid) + " matches none").c_str()
                                                                               : "no RoCEv2 IPv4 or global IPv6 GID");
      }
      std::vector<std::string> jg;
      for (auto& r : rows)
        jg.push_back(JObj().num("index", r.e.index).str("type", r.type).str("address", r.addr).str("netdev", r.netdev).done());
      JObj jp;
      jp.num("port", p).str("state", ::ibv_port_state_str(pa.state)).str("link_layer", ib ? "InfiniBand" : "Ethernet")
          .num("active_mtu", 128u << static_cast<int>(pa.active_mtu)).num("max_msg_sz", pa.max_msg_sz)
          .raw("gids", jarr(jg)).inum("hcomm_gid", pick < 0 ? -1 : rows[static_cast<size_t>(pick)].e.index)
          .boolean("hcomm_port", use);
      jports.push_back(jp.done());
    }
    ::ibv_close_device(c);
    jd.raw("ports", jarr(jports));
    jdevs.push_back(jd.done());
  }
  if (list != nullptr) ::ibv_free_device_list(list);
  if (o.json) {
    std::printf("%s\n", JObj().raw("devices", jarr(jdevs)).str("memlock_soft", limit_text(ml.rlim_cur))
                            .str("memlock_hard", limit_text(ml.rlim_max)).str("fork", fork)
                            .boolean("qemu_tcg", hcomm::under_qemu_tcg()).done().c_str());
  } else {
    if (jdevs.empty())
      std::printf("no RDMA device (for Soft-RoCE: modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0)\n");
    else if (!chosen)
      std::printf("no active port%s: the verbs transport would not open\n",
                  env_dev != nullptr || env_port != nullptr ? " matching HCOMM_IB_DEVICE / HCOMM_IB_PORT" : "");
    std::printf("RLIMIT_MEMLOCK: soft %s, hard %s (registered memory is pinned against it)\n",
                limit_text(ml.rlim_cur).c_str(), limit_text(ml.rlim_max).c_str());
    std::printf("rdma-core fork support: %s\n", fork);
    // Over Soft-RoCE the NIC is this CPU: whether waits use the pause hint matters (common/barrier.h).
    std::printf("CPU: %s\n", hcomm::under_qemu_tcg() ? "QEMU TCG guest (busy polls run without the pause hint)"
                                                     : "not QEMU TCG (busy polls use the pause hint)");
  }
  return 0;
}
#endif

void usage() {
  std::fprintf(stderr,
               "usage: hcomm-probe [--json] [--sim-dir DIR] list\n"
               "       hcomm-probe [--json] [--sim-dir DIR] info DEV\n"
               "       hcomm-probe [--json] [--sim-dir DIR] selftest DEV\n"
#if HCOMM_HAVE_IBVERBS
               "       hcomm-probe [--json] rdma       RDMA devices, ports, GIDs (verbs transport)\n"
#endif
               "DEV: sim:N (simulated NPU N) or a PCI address bound to vfio-pci.\n");
}

}  // namespace

int main(int argc, char** argv) {
  hcomm::tools::ProbeOptions po;
  std::string why;
  switch (hcomm::tools::parse_probe_args(std::vector<std::string>(argv + 1, argv + argc), HCOMM_HAVE_IBVERBS != 0,
                                         &po, &why)) {
    case hcomm::tools::Parsed::help:
      usage();
      return 0;
    case hcomm::tools::Parsed::usage_error:
      std::fprintf(stderr, "hcomm-probe: %s\n", why.c_str());
      usage();
      return 2;
    case hcomm::tools::Parsed::run:
      break;
  }
  Opts o;
  o.json = po.json;
  if (!po.sim_dir.empty()) o.sim_dir = po.sim_dir;
  using C = hcomm::tools::ProbeOptions::Command;
  switch (po.command) {
    case C::version:
      std::printf("hcomm-probe %s\n", HCOMM_VERSION);
      return 0;
    case C::list:
      return cmd_list(o);
    case C::info:
      return cmd_info(o, po.device);
    case C::selftest:
      return cmd_selftest(o, po.device);
#if HCOMM_HAVE_IBVERBS
    case C::rdma:
      return cmd_rdma(o);
#endif
    default:
      usage();
      return 2;
  }
}
