#include "coordinator/kernel_shaper.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "common/subprocess.h"

namespace xd {

Expected<KernelShaper> KernelShaper::load(const std::string& state_path) {
  std::ifstream in(state_path);
  if (!in) return Status::not_found("no network-namespace cluster: cannot read " + state_path +
                                    " (start one with scripts/netns-cluster.sh up)");
  KernelShaper k;
  k.state_path_ = state_path;
  try {
    nlohmann::json j;
    in >> j;
    const auto& tbf = j.at("tbf");
    k.dev_ = tbf.at("dev").get<std::string>();
    k.parent_ = tbf.at("parent").get<std::string>();
    k.handle_ = tbf.at("handle").get<std::string>();
    for (const auto& w : j.at("workers")) k.namespaces_.push_back(w.at("ns").get<std::string>());
  } catch (const std::exception& e) {
    return Status::corruption(state_path + ": " + e.what());
  }
  if (k.namespaces_.empty()) return Status::corruption(state_path + ": no workers");
  return k;
}

std::vector<std::string> KernelShaper::tbf_args(double bits_per_s) {
  const double burst = std::max(65536.0, bits_per_s / 8 * 0.004);
  return {"rate", std::to_string(static_cast<long long>(std::llround(bits_per_s))) + "bit", "burst",
          std::to_string(static_cast<long long>(std::llround(burst))), "latency", "100ms"};
}

Status KernelShaper::set_rate(double bytes_per_s) {
  if (!(bytes_per_s > 0) || !std::isfinite(bytes_per_s))
    return Status::invalid_argument("a kernel-shaped link needs a finite rate > 0");
  // Every namespace's tc at once, each given 2 s: the coordinator's thread
  // waits, and workers expect a heartbeat every second.
  const std::string ip = ::access("/usr/sbin/ip", X_OK) == 0 ? "/usr/sbin/ip" : "/sbin/ip";
  std::vector<subprocess::Child> children;
  for (size_t i = 0; i < namespaces_.size(); ++i) {
    std::vector<std::string> argv = {ip,     "netns", "exec", namespaces_[i], "tc",    "qdisc", "change",
                                     "dev",  dev_,    "parent", parent_,     "handle", handle_, "tbf"};
    for (const std::string& a : tbf_args(bytes_per_s * 8)) argv.push_back(a);
    children.push_back(subprocess::spawn(argv, state_path_ + ".tc" + std::to_string(i) + ".log"));
  }
  std::string failed;
  for (size_t i = 0; i < children.size(); ++i) {
    const int code = subprocess::wait_for(children[i], std::chrono::seconds(2));
    if (code != 0)
      failed += " " + namespaces_[i] + " (" + std::to_string(code) + "): " + subprocess::read_text(children[i].log_path);
  }
  if (!failed.empty()) return Status::unavailable("tc qdisc change failed, so the rates now differ:" + failed);
  // The state file says the rate in force, for status and the next launch.
  std::ifstream in(state_path_);
  nlohmann::json j;
  try {
    in >> j;
    j["inter_dc_rate"] = std::to_string(static_cast<long long>(std::llround(bytes_per_s * 8))) + "bit";
    j["inter_dc_rate_bits_per_s"] = bytes_per_s * 8;
    const std::string text = j.dump(1);
    return write_file_atomic(state_path_, text.data(), text.size());
  } catch (const std::exception& e) {
    return Status::corruption(state_path_ + ": " + e.what());
  }
}

}  // namespace xd
