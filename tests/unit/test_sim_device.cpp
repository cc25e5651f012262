// The device model's register file, config space and ATT, driven directly
// (no transport): the rules of docs/device-abi.md §2-§7.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "sim/control.h"
#include "sim/device.h"

namespace hcomm::sim {
namespace {

namespace reg = abi::reg;

class SimDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    for (uint32_t i = 0; i < 2; ++i) {
      DeviceConfig cfg;
      cfg.fabric_index = i;
      cfg.hbm_size = 1 << 20;
      cfg.num_queues = 2;
      cfg.num_att = 8;
      auto d = std::make_unique<Device>(cfg, &fabric_);
      ASSERT_TRUE(d->init());
      ASSERT_TRUE(fabric_.add(std::move(d)));
    }
    dev_ = fabric_.device(0);
  }
  uint32_t r32(uint32_t off) {
    uint32_t v = 0xdeadbeef;
    EXPECT_TRUE(dev_->bar0_read(off, &v, 4));
    return v;
  }
  uint64_t r64(uint32_t off) {
    uint64_t v = 0;
    EXPECT_TRUE(dev_->bar0_read(off, &v, 8));
    return v;
  }
  void w32(uint32_t off, uint32_t v) { EXPECT_TRUE(dev_->bar0_write(off, &v, 4)); }
  void w64(uint32_t off, uint64_t v) { EXPECT_TRUE(dev_->bar0_write(off, &v, 8)); }
  uint32_t att(uint32_t idx, uint64_t iova, uint64_t len, uint64_t target, uint32_t flags) {
    w32(reg::ATT_INDEX, idx);
    w64(reg::ATT_IOVA, iova);
    w64(reg::ATT_LEN, len);
    w64(reg::ATT_TARGET, target);
    w32(reg::ATT_FLAGS, flags);
    w32(reg::ATT_CMD, abi::att_cmd::WRITE);
    return r32(reg::ATT_STATUS);
  }

  Fabric fabric_;
  Device* dev_ = nullptr;
};

TEST_F(SimDevice, IdentityRegisters) {
  EXPECT_EQ(r32(reg::ID), abi::kPciVendorId | (uint32_t{abi::kPciDeviceId} << 16));
  EXPECT_EQ(r32(reg::ABI_VERSION), abi::kAbiVersion);
  EXPECT_EQ(r64(reg::HBM_SIZE), 1u << 20);
  EXPECT_EQ(r32(reg::HBM_SIZE), 1u << 20) << "low half of a 64-bit register";
  EXPECT_EQ(r32(reg::HBM_SIZE + 4), 0u) << "high half";
  EXPECT_EQ(r32(reg::NUM_QUEUES), 2u);
  EXPECT_EQ(r32(reg::NUM_ATT), 8u);
  EXPECT_EQ(r32(reg::FABRIC_SIZE), 2u);
  EXPECT_EQ(r32(reg::STATUS) & abi::status::READY, abi::status::READY);
  EXPECT_EQ(r32(0xffc), 0u) << "reserved offsets read as zero";
}

TEST_F(SimDevice, AccessRulesReadOnlyScratchAndReset) {
  w32(reg::NUM_QUEUES, 99);
  EXPECT_EQ(r32(reg::NUM_QUEUES), 2u) << "RO registers ignore writes";
  w32(reg::SCRATCH, 0x12345678);
  EXPECT_EQ(r32(reg::SCRATCH), 0x12345678u);
  uint16_t two = 0;
  EXPECT_FALSE(dev_->bar0_read(reg::SCRATCH, &two, 2)) << "2-byte access refused";
  uint32_t v = 0;
  EXPECT_FALSE(dev_->bar0_read(reg::SCRATCH + 1, &v, 4)) << "misaligned access refused";
  EXPECT_FALSE(dev_->bar0_read(abi::kBar0Size, &v, 4)) << "past BAR0 refused";
  w32(reg::CONTROL, abi::ctrl::ENABLE);
  EXPECT_NE(r32(reg::STATUS) & abi::status::ENABLED, 0u);
  w32(reg::CONTROL, abi::ctrl::RESET);
  EXPECT_EQ(r32(reg::CONTROL), 0u) << "RESET self-clears and disables";
  EXPECT_EQ(r32(reg::SCRATCH), 0u) << "reset restores defaults";
}

TEST_F(SimDevice, SixtyFourBitRegistersTakeTwoHalves) {
  w32(reg::ATT_IOVA, 0x89abcdef);
  w32(reg::ATT_IOVA + 4, 0x01234567);
  EXPECT_EQ(r64(reg::ATT_IOVA), 0x0123456789abcdefull);
  w32(reg::ATT_IOVA, 0);
  EXPECT_EQ(r64(reg::ATT_IOVA), 0x0123456700000000ull);
}

TEST_F(SimDevice, AttStatusCodes) {
  using namespace abi;
  EXPECT_EQ(att(8, 0x1000, 4096, 0, att::READ | att::KIND_HBM), att_status::BAD_INDEX);
  EXPECT_EQ(att(0, 0x1000, 0, 0, att::READ | att::KIND_HBM), att_status::BAD_RANGE);
  EXPECT_EQ(att(0, ~0ull - 10, 4096, 0, att::READ | att::KIND_HBM), att_status::BAD_RANGE) << "IOVA wraps";
  EXPECT_EQ(att(0, 0x1000, 4096, (1 << 20) - 4095, att::READ | att::KIND_HBM), att_status::BAD_RANGE);
  EXPECT_EQ(att(0, 0x1000, 4096, 0, att::KIND_HBM), att_status::BAD_FLAGS);
  EXPECT_EQ(att(0, 0x1000, 4096, 0, att::READ | (1u << 20)), att_status::BAD_FLAGS) << "unknown bit";
  EXPECT_EQ(att(0, 0x1000, 4096, 0, att::READ | att::KIND_HBM | (1u << att::PEER_SHIFT)), att_status::BAD_FLAGS)
      << "peer index on a non-peer entry";
  EXPECT_EQ(att(0, 0x1000, 4096, 0, att::READ | att::KIND_PEER_HBM | (2u << att::PEER_SHIFT)), att_status::BAD_FLAGS);
  EXPECT_EQ(att(0, 0x1000, 4096, 0, att::READ | att::KIND_PEER_HBM | (1u << att::PEER_SHIFT)), att_status::OK);
  EXPECT_EQ(att(1, 0x1800, 4096, 0, att::READ | att::KIND_HBM), att_status::OVERLAP);
  EXPECT_EQ(att(0, 0x1000, 8192, 0, att::READ | att::KIND_HBM), att_status::OK) << "rewriting an entry in place";
  EXPECT_EQ(att(1, 0x8000, 4096, 0x10000, att::READ | att::KIND_HOST), att_status::NOT_MAPPED);
  w32(reg::ATT_CMD, 77);
  EXPECT_EQ(r32(reg::ATT_STATUS), att_status::BAD_CMD);
}

TEST_F(SimDevice, DmaMapValidation) {
  int fd = ::memfd_create("t", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 8192), 0);
  EXPECT_FALSE(dev_->dma_map(0x1001, 4096, ::dup(fd), 0, 3)) << "unaligned";
  EXPECT_FALSE(dev_->dma_map(0x1000, 0, ::dup(fd), 0, 3)) << "empty";
  EXPECT_FALSE(dev_->dma_map(0x1000, 4096, ::dup(fd), 0, 0)) << "no rights";
  EXPECT_FALSE(dev_->dma_map(0x1000, 4096, -1, 0, 3)) << "no fd";
  EXPECT_TRUE(dev_->dma_map(0x10000, 8192, ::dup(fd), 0, 3));
  EXPECT_FALSE(dev_->dma_map(0x11000, 4096, ::dup(fd), 0, 3)) << "overlap";
  EXPECT_FALSE(dev_->dma_unmap(0x10000, 4096)) << "partial unmap";
  EXPECT_TRUE(dev_->dma_unmap(0x10000, 8192));
  EXPECT_FALSE(dev_->dma_unmap(0x10000, 8192)) << "double unmap";
  ::close(fd);
}

TEST_F(SimDevice, ConfigSpaceIdentityAndBounds) {
  uint16_t ids[2];
  ASSERT_TRUE(dev_->config_read(0, ids, 4));
  EXPECT_EQ(ids[0], abi::kPciVendorId);
  EXPECT_EQ(ids[1], abi::kPciDeviceId);
  uint8_t cap = 0;
  ASSERT_TRUE(dev_->config_read(0x34, &cap, 1));
  uint8_t id = 0;
  ASSERT_TRUE(dev_->config_read(cap, &id, 1));
  EXPECT_EQ(id, 0x11) << "MSI-X capability";
  uint16_t cmd = 0xffff;
  ASSERT_TRUE(dev_->config_write(4, &cmd, 2));
  ASSERT_TRUE(dev_->config_read(4, &cmd, 2));
  EXPECT_EQ(cmd, 0x0006) << "only memory space and bus master are writable";
  uint32_t v;
  EXPECT_FALSE(dev_->config_read(254, &v, 4));
}

TEST_F(SimDevice, ControlCommands) {
  EXPECT_EQ(control_command(fabric_, "ping"), "ok");
  EXPECT_EQ(control_command(fabric_, "fail 1 3"), "ok");
  EXPECT_EQ(fabric_.device(1)->faults().fail_next.load(), 3u);
  EXPECT_EQ(control_command(fabric_, "clear 1"), "ok");
  EXPECT_EQ(fabric_.device(1)->faults().fail_next.load(), 0u);
  EXPECT_EQ(control_command(fabric_, "stats 0"), "ok completed=0 errors=0");
  EXPECT_EQ(control_command(fabric_, "fail 2 1").rfind("error", 0), 0u);
  EXPECT_EQ(control_command(fabric_, "fail 0 -1").rfind("error", 0), 0u);
  EXPECT_EQ(control_command(fabric_, "fail 0").rfind("error", 0), 0u);
  EXPECT_EQ(control_command(fabric_, "").rfind("error", 0), 0u);
  EXPECT_EQ(control_command(fabric_, "explode 0 1").rfind("error", 0), 0u);
}

}  // namespace
}  // namespace hcomm::sim
