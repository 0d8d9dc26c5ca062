// Host-side check of the bounds behind the Hopper forward's fixed-offset
// softmax of softcapped scores (csrc/include/jflash/score.h,
// softcap_fixed_offset_fits): for every softcap it accepts, every exponent
// C t - offset (t in [-1, 1]) stays in [kSoftcapFixedLow, kSoftcapFixedHigh];
// it accepts exactly the caps up to 56.8; and that range keeps P a normal
// float (bfloat16 has float's exponent range) and a row's sums of 2^31 terms
// finite. Compiled and run by tests/test_cuda_library.py; prints "ok".
#include <cmath>
#include <limits>

#include "host_check.h"
#include "jflash/score.h"

using namespace jflash;

int main() {
  const float log2e = 1.4426950408889634f;
  for (int i = 1; i <= 4000; ++i) {
    const float softcap = 0.05f * i;  // 0.05 .. 200
    const float scale = softcap * log2e;
    const float offset = softcap_fixed_offset(scale);
    const bool fits = softcap_fixed_offset_fits(scale);
    CHECK(offset >= 0.f);
    CHECK(scale - offset <= kSoftcapFixedHigh);  // t = 1
    CHECK(fits == (-scale - offset >= kSoftcapFixedLow));  // t = -1
    CHECK(fits == (scale <= 82.f));
    if (softcap <= 56.8f) CHECK(fits);
    if (softcap >= 56.9f) CHECK(!fits);
  }
  CHECK(!softcap_fixed_offset_fits(0.f) && !softcap_fixed_offset_fits(-1.f));
  CHECK(std::ldexp(1.f, static_cast<int>(kSoftcapFixedLow)) >= std::numeric_limits<float>::min());
  CHECK(std::ldexp(1.f, static_cast<int>(kSoftcapFixedHigh) + 31) <
        std::numeric_limits<float>::max());
  return host_check::report();
}
