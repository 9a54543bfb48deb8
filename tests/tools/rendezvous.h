// File-based rendezvous for test processes started without a coordinator:
// each writes its endpoint to DIR/<rank>.ep (atomically) and reads the others'.
#pragma once

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace xd::testing {

inline Expected<std::vector<std::string>> rendezvous(const std::string& dir, int rank, int world,
                                                     const std::string& my_endpoint,
                                                     std::chrono::seconds timeout) {
  namespace fs = std::filesystem;
  const std::string tmp = dir + "/" + std::to_string(rank) + ".tmp";
  {
    std::ofstream out(tmp);
    out << my_endpoint;
  }
  fs::rename(tmp, dir + "/" + std::to_string(rank) + ".ep");
  std::vector<std::string> eps(world);
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (int r = 0; r < world; ++r) {
    const std::string path = dir + "/" + std::to_string(r) + ".ep";
    while (!fs::exists(path)) {
      if (std::chrono::steady_clock::now() > until)
        return Status::timeout("rendezvous: rank " + std::to_string(r) + " never showed up");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::ifstream in(path);
    std::getline(in, eps[r]);
  }
  return eps;
}

}  // namespace xd::testing
