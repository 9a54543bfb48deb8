#include "coordinator/kernel_shaper.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

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
    k.rate_bytes_per_s_ = j.at("inter_dc_rate_bits_per_s").get<double>() / 8;
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
  for (const std::string& ns : namespaces_) {
    std::vector<std::string> argv = {"/usr/sbin/ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev_,
                                     "parent",       parent_, "handle", handle_, "tbf"};
    for (const std::string& a : tbf_args(bytes_per_s * 8)) argv.push_back(a);
    const std::string log = state_path_ + ".tc.log";
    subprocess::Child c = subprocess::spawn(argv, log);
    const int code = subprocess::wait_for(c, std::chrono::seconds(10));
    if (code != 0)
      return Status::unavailable("tc qdisc change in " + ns + " failed (" + std::to_string(code) +
                                 "): " + subprocess::read_text(log));
  }
  rate_bytes_per_s_ = bytes_per_s;
  return Status::ok();
}

}  // namespace xd
