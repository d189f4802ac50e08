#include "base/check.h"

#include "gtest/gtest.h"

namespace swirl {
namespace {

TEST(CheckDeathTest, FailedCheckAbortsNamingTheCondition) {
  const int x = 1;
  EXPECT_DEATH(SWIRL_CHECK(x == 2), "check_test.cc:[0-9]+: check failed: x == 2");
}

TEST(CheckTest, PassingCheckEvaluatesOnce) {
  int evaluated = 0;
  SWIRL_CHECK(++evaluated == 1);
  EXPECT_EQ(evaluated, 1);
}

#if SWIRL_DCHECK_IS_ON
TEST(CheckDeathTest, DcheckIsOnInTestBuilds) {
  EXPECT_DEATH(SWIRL_DCHECK(false), "check failed: false");
}
#else
TEST(CheckTest, DcheckDoesNotEvaluateInOptimizedBuilds) {
  int evaluated = 0;
  SWIRL_DCHECK(++evaluated == 1);
  EXPECT_EQ(evaluated, 0);
}
#endif

}  // namespace
}  // namespace swirl
