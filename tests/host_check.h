// The checks of the host-side test programs (tests/*_check.cc, compiled and
// run by tests/test_cuda_library.py): CHECK counts failures and prints the
// first 20; a program ends with `return host_check::report();`, which prints "ok"
// when none failed.
#pragma once

#include <cstdio>

namespace host_check {
inline int failures = 0;
inline int report() {
  std::printf(failures ? "FAILED: %d checks\n" : "ok\n", failures);
  return failures != 0;
}
}  // namespace host_check

#define CHECK(cond)                                                                       \
  do {                                                                                    \
    if (!(cond) && host_check::failures++ < 20) {                                         \
      std::printf("FAIL %s line %d: %s\n", __FILE__, __LINE__, #cond);                    \
    }                                                                                     \
  } while (0)
