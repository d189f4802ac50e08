// What swirl's fuzz targets share (fuzz/BUILD): how a target reports a broken property, and a
// reader for the structured parts of an input.
//
// A property a target checks is not an expectation of one test: it must hold for every input,
// so a violation is a crash. libFuzzer then keeps the input (crash-*), and the replay test of the
// ordinary build (replay_main.cc) fails on the case that holds it.

#ifndef SWIRL_FUZZ_FUZZ_SUPPORT_H_
#define SWIRL_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace swirl::fuzz {

[[noreturn]] inline void PropertyFailed(const char* file, int line, const char* condition,
                                        const std::string& detail) {
  std::fprintf(stderr, "%s:%d: fuzz property failed: %s%s%s\n", file, line, condition,
               detail.empty() ? "" : ": ", detail.c_str());
  std::fflush(stderr);
  std::abort();
}

// FUZZ_CHECK(cond) or FUZZ_CHECK(cond, detail): aborts with the condition (and a std::string
// detail) when it does not hold.
#define FUZZ_CHECK(condition, ...)                                                          \
  do {                                                                                      \
    if (!(condition)) {                                                                     \
      ::swirl::fuzz::PropertyFailed(__FILE__, __LINE__, #condition, std::string(__VA_ARGS__)); \
    }                                                                                       \
  } while (0)

// Takes fixed-size values off the front of an input; past its end, zeros. A target reads its
// structured fields through this, so every input, however short, means something.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  template <typename T>
  T Take() {
    T value{};
    const size_t n = sizeof(T) < size_ ? sizeof(T) : size_;
    std::memcpy(&value, data_, n);
    data_ += n;
    size_ -= n;
    return value;
  }
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  const uint8_t* data() const { return data_; }
  // The rest, as bytes.
  std::string Rest() {
    std::string out(reinterpret_cast<const char*>(data_), size_);
    data_ += size_;
    size_ = 0;
    return out;
  }
  // Up to `n` bytes.
  std::string TakeBytes(size_t n) {
    if (n > size_) n = size_;
    std::string out(reinterpret_cast<const char*>(data_), n);
    data_ += n;
    size_ -= n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

}  // namespace swirl::fuzz

#endif  // SWIRL_FUZZ_FUZZ_SUPPORT_H_
