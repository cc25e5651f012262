// UniqueFd: owns one file descriptor; closes it once.
#pragma once

#include <unistd.h>

#include <utility>

namespace hcomm {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : _fd(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : _fd(std::exchange(o._fd, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o._fd, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return _fd; }
  bool valid() const noexcept { return _fd >= 0; }
  int release() noexcept { return std::exchange(_fd, -1); }
  void reset(int fd = -1) noexcept {
    if (_fd >= 0) ::close(_fd);
    _fd = fd;
  }

 private:
  int _fd = -1;
};

}  // namespace hcomm
