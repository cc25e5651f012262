// The simulator's uplink on a DPDK ethdev (Debian's libdpdk): poll-mode,
// no kernel socket in the path.
//  - net_memif: two simulators linked as two nodes over shared-memory rings
//    (one --uplink dpdk:net_memif0,role=server,socket=..., the other
//    role=client on the same socket);
//  - net_tap: a kernel tap interface, so the host's own stack (ARP, and a
//    kernel RoCE device on a bridge) is on the engine's wire;
//  - a PCI address: a NIC bound to vfio-pci on bare metal (hugepages needed).
// The EAL is started once per process, without hugepages for virtual
// devices, its runtime files under the simulator's directory; the main
// thread keeps the CPUs it had (the EAL would pin it to one core).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "sim/roce/port.h"

namespace hcomm::sim::roce {

// devargs: a virtual device ("net_memif0,role=server,socket=/x") or a PCI
// address ("0000:03:00.0"). HCOMM_SIM_DPDK_EAL adds EAL arguments
// (whitespace-separated). Fails with a clear status when the simulator was
// built without DPDK, the EAL does not start, or the device does not probe.
Status open_dpdk_link(const std::string& devargs, const std::string& run_dir, std::unique_ptr<Link>* out);

}  // namespace hcomm::sim::roce
