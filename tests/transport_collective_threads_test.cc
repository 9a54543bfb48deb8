// The pool that runs collective bodies: bodies run concurrently (a body never
// waits behind another), handles report each body's Status, and destroying a
// handle waits for its body.
#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "transport/communicator.h"
#include "transport/detail/collective_threads.h"

namespace xd {
namespace {

CollectiveHandle start(std::function<Status()> body) {
  return CollectiveHandle(detail::run_collective(std::move(body)));
}

TEST(CollectiveThreads, ABodyThatWaitsForALaterOneDoesNotBlockIt) {
  // Across ranks, collective A can need collective B's progress; one thread
  // running bodies in order would deadlock here.
  for (int round = 0; round < 20; ++round) {
    std::promise<void> b_ran;
    std::shared_future<void> b_done = b_ran.get_future().share();
    CollectiveHandle a = start([b_done] {
      if (b_done.wait_for(std::chrono::seconds(10)) != std::future_status::ready)
        return Status::timeout("B never ran");
      return Status::ok();
    });
    CollectiveHandle b = start([&b_ran] {
      b_ran.set_value();
      return Status::ok();
    });
    EXPECT_TRUE(b.wait().is_ok());
    Status sa = a.wait();
    ASSERT_TRUE(sa.is_ok()) << sa.to_string();
  }
}

TEST(CollectiveThreads, EachHandleReturnsItsOwnBodysStatusEveryTimeItIsAsked) {
  std::vector<CollectiveHandle> handles;
  for (int i = 0; i < 16; ++i)
    handles.push_back(start([i] { return i % 3 ? Status::ok() : Status::invalid_argument("body " + std::to_string(i)); }));
  for (int i = 0; i < 16; ++i) {
    Status first = handles[i].wait();
    Status again = handles[i].wait();
    EXPECT_EQ(first.is_ok(), i % 3 != 0) << i;
    EXPECT_EQ(first.to_string(), again.to_string());
    if (i % 3 == 0) {
      EXPECT_NE(first.to_string().find("body " + std::to_string(i)), std::string::npos);
    }
  }
}

TEST(CollectiveThreads, EveryBodyRunsExactlyOnceWhetherAPoolThreadOrItsWaiterTakesIt) {
  // Waiting right away often finds the body not yet taken and runs it in the
  // waiter; waiting late finds it done by the pool. Both must run it once.
  constexpr int kBodies = 200;
  std::vector<std::atomic<int>> runs(kBodies);
  std::vector<CollectiveHandle> late;
  for (int i = 0; i < kBodies; ++i) {
    CollectiveHandle h = start([&runs, i] {
      runs[i]++;
      return Status::ok();
    });
    if (i % 2) EXPECT_TRUE(h.wait().is_ok());
    else late.push_back(std::move(h));
  }
  for (auto& h : late) EXPECT_TRUE(h.wait().is_ok());
  for (int i = 0; i < kBodies; ++i) EXPECT_EQ(runs[i].load(), 1) << "body " << i;
}

int threads_in_process() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  while (dirent* e = d ? readdir(d) : nullptr)
    if (e->d_name[0] != '.') ++n;
  if (d) closedir(d);
  return n;
}

TEST(CollectiveThreads, BodiesTheirWaitersRanDoNotMakeThePoolGrow) {
  // Waiting at once usually runs the body in the waiter; the queued entry it
  // leaves behind must not count as work that needs another thread.
  const int before = threads_in_process();
  int peak = before;
  for (int i = 0; i < 3000; ++i) {
    EXPECT_TRUE(start([] { return Status::ok(); }).wait().is_ok());
    if (i % 100 == 0) peak = std::max(peak, threads_in_process());
  }
  peak = std::max(peak, threads_in_process());
  EXPECT_LE(peak - before, 4) << "pool threads started: " << peak - before;
}

TEST(CollectiveThreads, DestroyingOrReplacingAHandleWaitsForItsBody) {
  std::atomic<int> finished{0};
  auto slow = [&finished] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    finished++;
    return Status::ok();
  };
  { CollectiveHandle h = start(slow); }
  EXPECT_EQ(finished.load(), 1);
  CollectiveHandle h = start(slow);
  h = start(slow);  // the first body borrowed buffers: it must be over now
  EXPECT_GE(finished.load(), 2);
  EXPECT_TRUE(h.wait().is_ok());
  EXPECT_EQ(finished.load(), 3);
}

TEST(CollectiveThreads, ManyConcurrentBodiesAllRunAtOnce) {
  // 32 bodies that each wait until all 32 have started: only possible if none
  // waits for a free thread.
  constexpr int kBodies = 32;
  std::atomic<int> started{0};
  std::vector<CollectiveHandle> handles;
  for (int i = 0; i < kBodies; ++i)
    handles.push_back(start([&started] {
      started++;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (started.load() < kBodies) {
        if (std::chrono::steady_clock::now() > deadline) return Status::timeout("not all bodies started");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return Status::ok();
    }));
  for (auto& h : handles) {
    Status s = h.wait();
    EXPECT_TRUE(s.is_ok()) << s.to_string();
  }
}

}  // namespace
}  // namespace xd
