// Fuzz targets are plain LLVMFuzzerTestOneInput functions. Built with clang
// and -Dlibfuzzer=true they link libFuzzer (coverage-guided, run by hand:
// `build-fuzz/tests/fuzz_vfio_user_server -max_total_time=300`). Otherwise
// standalone_main.cpp drives them in CI: every seed, then a fixed number of
// deterministic mutations of the seeds (bit flips, byte edits, truncation,
// splicing), so the 'fuzz' suite is repeatable and bounded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

// Seeds the target offers the standalone driver (valid inputs to mutate).
std::vector<std::string> fuzz_seeds();
