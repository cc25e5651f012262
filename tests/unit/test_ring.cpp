#include <gtest/gtest.h>

#include <vector>

#include "hal/abi/desc.h"
#include "hal/abi/ring.h"

namespace hcomm::hal::abi {
namespace {

TEST(Ring, SlotsPhasesAndOccupancyAcrossIndexWrap) {
  std::vector<CqEntry> e(8);
  Ring<CqEntry> r(e.data(), 3);
  EXPECT_EQ(r.size(), 8u);
  EXPECT_EQ(&r.at(0), &e[0]);
  EXPECT_EQ(&r.at(9), &e[1]);
  EXPECT_EQ(r.phase(0), 1u);  // first pass over a zeroed ring writes phase 1
  EXPECT_EQ(r.phase(7), 1u);
  EXPECT_EQ(r.phase(8), 0u);
  EXPECT_EQ(r.phase(16), 1u);
  // Free-running 32-bit indices keep working across 2^32.
  uint32_t cons = 0xfffffffcu, prod = cons + 6;  // wraps to 2
  EXPECT_EQ(Ring<CqEntry>::used(prod, cons), 6u);
  EXPECT_EQ(r.free_slots(prod, cons), 2u);
  EXPECT_TRUE(r.valid_producer(prod, cons));
  EXPECT_FALSE(r.valid_producer(cons + 9, cons));
  EXPECT_FALSE(r.valid_producer(cons - 1, cons)) << "a producer behind the consumer is garbage";
}

TEST(Ring, SimulatedProducerConsumerPast65536Wraps) {
  // The phase rule must distinguish a new entry from a stale one on every pass.
  std::vector<CqEntry> e(4);
  Ring<CqEntry> r(e.data(), 2);
  uint32_t prod = 0, cons = 0;
  for (uint32_t i = 0; i < 4u * 70000u; ++i) {
    CqEntry& c = r.at(prod);
    ASSERT_NE(c.info & kCqPhase, r.phase(prod)) << "slot looks new before it was written, i=" << i;
    c.user_data = i;
    c.info = r.phase(prod);
    ++prod;
    CqEntry& d = r.at(cons);
    ASSERT_EQ(d.info & kCqPhase, r.phase(cons));
    ASSERT_EQ(d.user_data, i);
    ++cons;
  }
}

TEST(Abi, DescriptorLayoutAndNames) {
  EXPECT_EQ(sizeof(SqEntry), 64u);
  EXPECT_EQ(sizeof(CqEntry), 16u);
  EXPECT_EQ(sizeof(QueueShadow), 256u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::FP64), 8u);
  for (uint16_t s = 0; s < kCqStatusCount; ++s)
    EXPECT_STRNE(cq_status_name(static_cast<CqStatus>(s)), "UNKNOWN") << s;
  EXPECT_STREQ(cq_status_name(static_cast<CqStatus>(999)), "UNKNOWN");
}

}  // namespace
}  // namespace hcomm::hal::abi
