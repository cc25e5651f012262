// Element-wise reductions of the REDUCE opcode, shared by the device model
// (sim/) and the host engine (api/), so both compute bit-identical results (docs/device-abi.md §9.3):
// dst[i] = dst[i] op src[i]. Integers wrap (two's complement); fp16 and bf16
// are computed in fp32 and rounded to nearest-even; MAX/MIN follow fmax/fmin
// (a NaN operand loses to a number).
#pragma once

#include <cstddef>
#include <cstdint>

#include "hal/abi/desc.h"

namespace hcomm::hal::abi {

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

// dst and src need not be aligned; count elements of dtype.
void reduce(DType dtype, RedOp op, uint8_t* dst, const uint8_t* src, uint64_t count);

}  // namespace hcomm::hal::abi
