// ProgressLine: a live bar with the ETA on a terminal, plain lines elsewhere.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "common/progress.h"

namespace xd {
namespace {

std::string contents(FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

TEST(ProgressLine, OnATerminalALiveBarWithTheEtaIsRedrawnBelowTheLinesThatStay) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressLine p(f, /*terminal=*/true);
  p.live(5, 10, 50.0, "step 5/10");
  p.line("step 5 kept");
  p.live(6, 10, 60.0, "step 6/10");
  p.clear();
  EXPECT_EQ(contents(f),
            "\r\033[K[##########..........] step 5/10 | ETA 50 s"
            "\r\033[Kstep 5 kept\n"
            "\r\033[K[############........] step 6/10 | ETA 40 s"
            "\r\033[K");
  std::fclose(f);
}

TEST(ProgressLine, OffATerminalOnlyTheLinesThatStayArePrintedPlain) {
  FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressLine p(f, /*terminal=*/false);
  p.live(5, 10, 50.0, "step 5/10");
  p.line("step 5" + ProgressLine::eta(5, 10, 50.0));
  p.clear();
  EXPECT_EQ(contents(f), "step 5 | ETA 50 s\n");
  std::fclose(f);
}

TEST(ProgressLine, DurationsReadAsSecondsMinutesOrHoursAndFinishedWorkHasNoEta) {
  EXPECT_EQ(ProgressLine::duration(42.4), "42 s");
  EXPECT_EQ(ProgressLine::duration(185), "3m05s");
  EXPECT_EQ(ProgressLine::duration(3720), "1h02m");
  EXPECT_EQ(ProgressLine::eta(10, 10, 99), "");
  EXPECT_EQ(ProgressLine::eta(0, 10, 99), "");
}

}  // namespace
}  // namespace xd
