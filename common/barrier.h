// Device memory barriers, kept apart from C++ atomics (SPDK's spdk_wmb/rmb).
//
// CPU-to-CPU ordering (driver <-> sim engine thread, shadow indices) uses
// std::atomic with acquire/release/seq_cst. These barriers are for ordering
// plain stores to DMA memory against an MMIO doorbell write, which the C++
// memory model does not describe.
#pragma once

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

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#endif
}

}  // namespace hcomm
