// Device memory barriers, kept apart from C++ atomics (SPDK's spdk_wmb/rmb).
//
// CPU-to-CPU ordering (driver <-> sim engine thread, shadow indices) uses
// std::atomic with acquire/release/seq_cst. These barriers are for ordering
// plain stores to DMA memory against an MMIO doorbell write, which the C++
// memory model does not describe.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace hcomm {

// All earlier stores are visible to the device before any later store (MMIO).
inline void wmb() {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ __volatile__("sfence" ::: "memory");
#elif defined(__aarch64__)
  __asm__ __volatile__("dmb oshst" ::: "memory");
#else
  __sync_synchronize();
#endif
}

// True in a QEMU TCG guest: CPUID reports a hypervisor whose signature (leaf
// 0x40000000) is "TCGTCGTCGTCG", QEMU's for its binary translator.
inline bool under_qemu_tcg() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  __cpuid(1, a, b, c, d);
  if ((c & (1u << 31)) == 0) return false;  // no hypervisor
  __cpuid(0x40000000, a, b, c, d);
  const unsigned tcg[3] = {0x54474354u, 0x43544743u, 0x47435447u};  // "TCGT" "CGTC" "GTCG"
  return b == tcg[0] && c == tcg[1] && d == tcg[2];
#else
  return false;
#endif
}

// The pause hint of a busy poll. None in a QEMU TCG guest: there a PAUSE
// ends the translated block and leaves for QEMU's execution loop
// (helper_pause: cpu_loop_exit), thousands of times per wait, on the host
// CPUs that QEMU's I/O thread needs to deliver what the poll waits for (a
// Soft-RoCE round trip in the benchmark guests took 10-20 % longer).
// Elsewhere PAUSE is what keeps a spinning thread from starving its SMT
// sibling (without it a shm ping-pong on a 2-vCPU VM took 2-3x longer).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool plain = under_qemu_tcg();
  if (!plain) __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#endif
}

}  // namespace hcomm
