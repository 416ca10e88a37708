// A tiny assertion helper for the C++ unit tests, so they need nothing beyond the compiler.
//   RK_CHECK(cond, "printf format", args...)  counts a failure and prints the first few
//   return rktest::finish("name");            at the end of main: 0 if every check passed
#pragma once

#include <cstdio>

namespace rktest {

struct Counters {
  long checks = 0;
  long failures = 0;
};

inline Counters& counters() {
  static Counters c;
  return c;
}

constexpr long kMaxPrinted = 25;  // exhaustive loops could otherwise print thousands of lines

// True when a failure should be printed (and counts it).
inline bool record(bool ok) {
  Counters& c = counters();
  ++c.checks;
  if (ok) return false;
  return ++c.failures <= kMaxPrinted;
}

inline int finish(const char* name) {
  const Counters& c = counters();
  if (c.failures > kMaxPrinted) std::fprintf(stderr, "... %ld more failures not shown\n", c.failures - kMaxPrinted);
  std::printf("%s: %ld checks, %ld failed\n", name, c.checks, c.failures);
  return c.failures == 0 && c.checks > 0 ? 0 : 1;
}

}  // namespace rktest

#define RK_CHECK(cond, fmt, ...)                                                                   \
  do {                                                                                             \
    if (::rktest::record(static_cast<bool>(cond))) {                                              \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: " fmt "\n", __FILE__, __LINE__, #cond        \
                   __VA_OPT__(, ) __VA_ARGS__);                                                    \
    }                                                                                              \
  } while (0)
