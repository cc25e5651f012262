// Deterministic driver for the fuzz targets when libFuzzer is not linked.
//   fuzz_X [--iterations N] [--seed S] [FILE...]
//   fuzz_X --dump-seeds DIR   writes the target's seeds there (a libFuzzer corpus to start from)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "tests/fuzz/fuzz.h"

namespace {

std::string mutate(const std::vector<std::string>& seeds, std::mt19937_64& rng) {
  std::string s = seeds[rng() % seeds.size()];
  const int edits = 1 + static_cast<int>(rng() % 8);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 7) {
      case 0:  // flip a bit
        if (!s.empty()) s[rng() % s.size()] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // overwrite a byte with an interesting value
        if (!s.empty()) {
          static const uint8_t vals[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0xfe, 0x10, 0x40};
          s[rng() % s.size()] = static_cast<char>(vals[rng() % sizeof vals]);
        }
        break;
      case 2:  // truncate
        if (!s.empty()) s.resize(rng() % s.size());
        break;
      case 3:  // insert random bytes
        s.insert(s.begin() + static_cast<long>(s.empty() ? 0 : rng() % s.size()), static_cast<char>(rng()));
        break;
      case 4:  // splice another seed on
        s += seeds[rng() % seeds.size()];
        break;
      case 5:  // overwrite a 32-bit word (sizes, counts, offsets)
        if (s.size() >= 4) {
          uint32_t v = (rng() % 2) ? static_cast<uint32_t>(rng()) : (0xffffffffu >> (rng() % 32));
          std::memcpy(&s[(rng() % (s.size() - 3)) & ~size_t{3}], &v, 4);
        }
        break;
      default:  // duplicate a chunk
        if (!s.empty()) {
          size_t a = rng() % s.size();
          size_t n = 1 + rng() % std::min<size_t>(64, s.size() - a);
          s.insert(a, s.substr(a, n));
        }
        break;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  long iterations = 2000;
  unsigned long long seed = 1;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--iterations" && i + 1 < argc) iterations = std::strtol(argv[++i], nullptr, 10);
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--dump-seeds" && i + 1 < argc) {
      const std::string dir = argv[++i];
      int n = 0;
      for (const auto& s : fuzz_seeds()) {
        std::ofstream f(dir + "/seed-" + std::to_string(n++), std::ios::binary);
        f << s;
        if (!f) {
          std::fprintf(stderr, "cannot write %s/seed-%d\n", dir.c_str(), n - 1);
          return 1;
        }
      }
      std::printf("%d seeds written to %s\n", n, dir.c_str());
      return 0;
    }
    else {
      std::ifstream f(a, std::ios::binary);
      std::stringstream ss;
      ss << f.rdbuf();
      inputs.push_back(ss.str());
    }
  }
  std::vector<std::string> seeds = fuzz_seeds();
  seeds.insert(seeds.end(), inputs.begin(), inputs.end());
  seeds.push_back("");
  for (const auto& s : seeds) LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  std::mt19937_64 rng(seed);
  for (long i = 0; i < iterations; ++i) {
    std::string s = mutate(seeds, rng);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::printf("%zu seeds + %ld mutated inputs: no crash\n", seeds.size(), iterations);
  return 0;
}
