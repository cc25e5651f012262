#include "hal/abi/reduce.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace hcomm::hal::abi {

namespace abi = hcomm::hal::abi;

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u)  // inf or NaN (keep NaN quiet)
    return sign | (absx > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (absx >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to inf
  if (absx < 0x38800000u) {                        // below the smallest normal half: subnormal/zero
    if (absx < 0x33000000u) return sign;           // < 2^-25 rounds to 0
    uint32_t e = absx >> 23;
    uint32_t man = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e) - ... : bring to a 10-bit subnormal mantissa
    uint32_t half_man = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_man & 1u))) ++half_man;
    return sign | static_cast<uint16_t>(half_man);
  }
  uint32_t e = (absx >> 23) - 127 + 15;
  uint32_t man = absx & 0x7fffffu;
  uint32_t h = (e << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: correct
  return sign | static_cast<uint16_t>(h);
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

namespace {

// The operator is a template parameter so each (dtype, op) pair gets its own
// loop with no per-element branch on `op`: SUM and PROD over aligned,
// non-overlapping buffers vectorise (this library is built at -O3).
template <typename T, abi::RedOp Op>
inline T apply(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    // Wrap-around arithmetic in an unsigned type at least as wide as
    // unsigned int: narrower types would promote to (signed) int, where
    // 65535 * 65535 overflows.
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    if constexpr (Op == abi::RedOp::SUM) return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    if constexpr (Op == abi::RedOp::PROD) return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    if constexpr (Op == abi::RedOp::MAX) return a > b ? a : b;
    if constexpr (Op == abi::RedOp::MIN) return a < b ? a : b;
  } else {
    if constexpr (Op == abi::RedOp::SUM) return a + b;
    if constexpr (Op == abi::RedOp::PROD) return a * b;
    if constexpr (Op == abi::RedOp::MAX) return std::fmax(a, b);
    if constexpr (Op == abi::RedOp::MIN) return std::fmin(a, b);
  }
  return a;
}

bool disjoint(const uint8_t* a, const uint8_t* b, uint64_t bytes) { return a + bytes <= b || b + bytes <= a; }

template <typename T, abi::RedOp Op>
void reduce_loop(uint8_t* dst, const uint8_t* src, uint64_t n) {
  const uint64_t bytes = n * sizeof(T);
  if (reinterpret_cast<uintptr_t>(dst) % alignof(T) == 0 && reinterpret_cast<uintptr_t>(src) % alignof(T) == 0 &&
      disjoint(dst, src, bytes)) {
    T* __restrict d = reinterpret_cast<T*>(dst);
    const T* __restrict s = reinterpret_cast<const T*>(src);
    for (uint64_t i = 0; i < n; ++i) d[i] = apply<T, Op>(d[i], s[i]);
    return;
  }
  for (uint64_t i = 0; i < n; ++i) {  // unaligned or overlapping: element by element
    T a, b;
    std::memcpy(&a, dst + i * sizeof(T), sizeof(T));
    std::memcpy(&b, src + i * sizeof(T), sizeof(T));
    T r = apply<T, Op>(a, b);
    std::memcpy(dst + i * sizeof(T), &r, sizeof(T));
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), abi::RedOp Op>
void reduce_half(uint8_t* dst, const uint8_t* src, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    uint16_t a, b;
    std::memcpy(&a, dst + i * 2, 2);
    std::memcpy(&b, src + i * 2, 2);
    uint16_t r = FromF(apply<float, Op>(ToF(a), ToF(b)));
    std::memcpy(dst + i * 2, &r, 2);
  }
}

template <abi::RedOp Op>
void reduce_op(abi::DType dtype, uint8_t* dst, const uint8_t* src, uint64_t count) {
  switch (dtype) {
    case abi::DType::INT8: return reduce_loop<int8_t, Op>(dst, src, count);
    case abi::DType::INT16: return reduce_loop<int16_t, Op>(dst, src, count);
    case abi::DType::INT32: return reduce_loop<int32_t, Op>(dst, src, count);
    case abi::DType::INT64: return reduce_loop<int64_t, Op>(dst, src, count);
    case abi::DType::UINT8: return reduce_loop<uint8_t, Op>(dst, src, count);
    case abi::DType::UINT16: return reduce_loop<uint16_t, Op>(dst, src, count);
    case abi::DType::UINT32: return reduce_loop<uint32_t, Op>(dst, src, count);
    case abi::DType::UINT64: return reduce_loop<uint64_t, Op>(dst, src, count);
    case abi::DType::FP16: return reduce_half<half_to_float, float_to_half, Op>(dst, src, count);
    case abi::DType::BF16: return reduce_half<bf16_to_float, float_to_bf16, Op>(dst, src, count);
    case abi::DType::FP32: return reduce_loop<float, Op>(dst, src, count);
    case abi::DType::FP64: return reduce_loop<double, Op>(dst, src, count);
  }
}

}  // namespace

void reduce(abi::DType dtype, abi::RedOp op, uint8_t* dst, const uint8_t* src, uint64_t count) {
  switch (op) {
    case abi::RedOp::SUM: return reduce_op<abi::RedOp::SUM>(dtype, dst, src, count);
    case abi::RedOp::PROD: return reduce_op<abi::RedOp::PROD>(dtype, dst, src, count);
    case abi::RedOp::MAX: return reduce_op<abi::RedOp::MAX>(dtype, dst, src, count);
    case abi::RedOp::MIN: return reduce_op<abi::RedOp::MIN>(dtype, dst, src, count);
  }
}

}  // namespace hcomm::hal::abi
