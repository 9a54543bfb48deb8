#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "actors/actor.h"
#include "event.h"

namespace xd {
namespace {

using namespace std::chrono_literals;
using testing::Event;

class Recorder : public Actor {
 public:
  Recorder() : Actor("recorder", 20ms) {}
  ~Recorder() override {
    stop();
    join();
  }
  std::vector<int> seen;  // touched only on the actor thread
  std::atomic<int> ticks{0};
  std::atomic<bool> started{false}, stopped{false};
  Event three_ticks;

 protected:
  void on_start() override { started = true; }
  void on_tick() override {
    if (++ticks == 3) three_ticks.set();
  }
  void on_stop() override { stopped = true; }
};

TEST(Actor, RunsMessagesInOrderOnItsOwnThread) {
  Recorder r;
  r.start();
  std::thread::id actor_thread;
  Event done;
  for (int i = 0; i < 100; ++i) r.post([&r, i] { r.seen.push_back(i); });
  r.post([&] {
    actor_thread = std::this_thread::get_id();
    done.set();
  });
  ASSERT_TRUE(done.wait_for(10s));
  EXPECT_NE(actor_thread, std::this_thread::get_id());
  r.stop();
  r.join();
  ASSERT_EQ(r.seen.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(r.seen[i], i);
  EXPECT_TRUE(r.started && r.stopped);
}

TEST(Actor, UrgentMessagesOvertakeQueuedWork) {
  Recorder r;
  Event release, drained;
  r.post([&] { release.wait_for(10s); });  // busy actor
  for (int i = 0; i < 50; ++i) r.post([&r, i] { r.seen.push_back(i); });
  r.post([&] { drained.set(); });
  r.post([&r] { r.seen.push_back(-1); }, /*urgent=*/true);
  r.start();
  release.set();
  ASSERT_TRUE(drained.wait_for(10s));
  r.stop();
  r.join();
  ASSERT_EQ(r.seen.size(), 51u);
  EXPECT_EQ(r.seen[0], -1);
}

TEST(Actor, TicksWhileIdleAndStopsPromptly) {
  Recorder r;
  r.start();
  ASSERT_TRUE(r.three_ticks.wait_for(10s)) << "no ticks while idle";
  auto t0 = std::chrono::steady_clock::now();
  r.stop();
  r.join();
  EXPECT_GE(r.ticks.load(), 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 100ms);
}

TEST(Mailbox, ManyWritersOneReaderLoseNothing) {
  Mailbox<int> box;
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w)
    writers.emplace_back([&box, w] { for (int i = 0; i < 1000; ++i) box.push(w * 1000 + i); });
  for (auto& t : writers) t.join();
  std::vector<int> got;
  while (auto v = box.try_pop()) got.push_back(*v);
  ASSERT_EQ(got.size(), 4000u);
  std::sort(got.begin(), got.end());
  for (int i = 0; i < 4000; ++i) EXPECT_EQ(got[i], i);
}

}  // namespace
}  // namespace xd
