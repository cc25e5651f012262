#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "hal/abi/reduce.h"

namespace hcomm::hal::abi {
namespace {

namespace abi = hcomm::hal::abi;

uint16_t ref_half(float f) {
  _Float16 h = static_cast<_Float16>(f);  // the compiler's IEEE conversion (round to nearest even)
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

TEST(HalfFloat, EveryHalfRoundTripsExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = half_to_float(static_cast<uint16_t>(h));
    _Float16 ref;
    uint16_t hh = static_cast<uint16_t>(h);
    std::memcpy(&ref, &hh, 2);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(static_cast<float>(ref))) << std::hex << h;
      ASSERT_EQ(float_to_half(f) & 0x7c00u, 0x7c00u);
      continue;
    }
    ASSERT_EQ(f, static_cast<float>(ref)) << std::hex << h;
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
  }
}

TEST(HalfFloat, FloatToHalfRoundsLikeTheCompiler) {
  // Every 997th float bit pattern across the whole range, plus the halfway cases
  // around the subnormal and overflow edges.
  for (uint64_t u = 0; u <= 0xffffffffull; u += 997) {
    float f;
    uint32_t b = static_cast<uint32_t>(u);
    std::memcpy(&f, &b, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), ref_half(f)) << std::hex << b;
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.9802322e-8f, 5.9604645e-8f, 6.1035156e-5f, -0.0f})
    EXPECT_EQ(float_to_half(f), ref_half(f)) << f;
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  float f;
  uint32_t b = 0x3f808000u;  // exactly halfway between 0x3f80 and 0x3f81: to even
  std::memcpy(&f, &b, 4);
  EXPECT_EQ(float_to_bf16(f), 0x3f80);
  b = 0x3f818000u;  // halfway, odd below: rounds up
  std::memcpy(&f, &b, 4);
  EXPECT_EQ(float_to_bf16(f), 0x3f82);
  b = 0x3f808001u;
  std::memcpy(&f, &b, 4);
  EXPECT_EQ(float_to_bf16(f), 0x3f81);
  EXPECT_EQ(bf16_to_float(0xc040), -3.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Reduce, IntegersWrapAndMinMaxAreSigned) {
  int8_t d[3] = {127, -128, -5};
  int8_t s[3] = {1, -1, 3};
  reduce(abi::DType::INT8, abi::RedOp::SUM, reinterpret_cast<uint8_t*>(d), reinterpret_cast<uint8_t*>(s), 3);
  EXPECT_EQ(d[0], -128);
  EXPECT_EQ(d[1], 127);
  EXPECT_EQ(d[2], -2);
  int32_t a[2] = {-7, 5}, b[2] = {3, -9};
  reduce(abi::DType::INT32, abi::RedOp::MIN, reinterpret_cast<uint8_t*>(a), reinterpret_cast<uint8_t*>(b), 2);
  EXPECT_EQ(a[0], -7);
  EXPECT_EQ(a[1], -9);
  uint32_t u[1] = {0xffffffffu}, v[1] = {2};
  reduce(abi::DType::UINT32, abi::RedOp::MAX, reinterpret_cast<uint8_t*>(u), reinterpret_cast<uint8_t*>(v), 1);
  EXPECT_EQ(u[0], 0xffffffffu);
  int64_t p[1] = {INT64_MAX}, q[1] = {2};
  reduce(abi::DType::INT64, abi::RedOp::PROD, reinterpret_cast<uint8_t*>(p), reinterpret_cast<uint8_t*>(q), 1);
  EXPECT_EQ(p[0], -2);
}

TEST(Reduce, NarrowProductsWrapWithoutSignedOverflow) {
  uint16_t a[1] = {65535}, b[1] = {65535};
  reduce(abi::DType::UINT16, abi::RedOp::PROD, reinterpret_cast<uint8_t*>(a), reinterpret_cast<uint8_t*>(b), 1);
  EXPECT_EQ(a[0], 1u);  // 65535^2 mod 2^16
  int16_t c[1] = {-32768}, d[1] = {-32768};
  reduce(abi::DType::INT16, abi::RedOp::PROD, reinterpret_cast<uint8_t*>(c), reinterpret_cast<uint8_t*>(d), 1);
  EXPECT_EQ(c[0], 0);
}

TEST(Reduce, UnalignedBuffersAndFloatNanHandling) {
  alignas(8) uint8_t dst[1 + 8], src[3 + 8];
  double x = 1.5, y = std::numeric_limits<double>::quiet_NaN();
  std::memcpy(dst + 1, &x, 8);
  std::memcpy(src + 3, &y, 8);
  reduce(abi::DType::FP64, abi::RedOp::MAX, dst + 1, src + 3, 1);
  double r;
  std::memcpy(&r, dst + 1, 8);
  EXPECT_EQ(r, 1.5) << "fmax: a NaN operand loses to a number";
  uint16_t h[2] = {float_to_half(1.5f), float_to_half(-2.0f)}, g[2] = {float_to_half(2.25f), float_to_half(4.0f)};
  reduce(abi::DType::FP16, abi::RedOp::PROD, reinterpret_cast<uint8_t*>(h), reinterpret_cast<uint8_t*>(g), 2);
  EXPECT_EQ(half_to_float(h[0]), 3.375f);
  EXPECT_EQ(half_to_float(h[1]), -8.0f);
}

}  // namespace
}  // namespace hcomm::hal::abi
