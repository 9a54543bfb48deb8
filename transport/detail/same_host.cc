#include "transport/detail/same_host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstring>

namespace xd::detail {
namespace {

// "tcp://host:port" or "tcp://[v6]:port" -> host; "" if not a TCP endpoint.
std::string tcp_host(const std::string& endpoint) {
  const std::string scheme = "tcp://";
  if (endpoint.compare(0, scheme.size(), scheme) != 0) return "";
  std::string rest = endpoint.substr(scheme.size());
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    return close == std::string::npos ? "" : rest.substr(1, close - 1);
  }
  const size_t colon = rest.rfind(':');
  return colon == std::string::npos ? "" : rest.substr(0, colon);
}

bool is_own_address(int family, const void* addr) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != family) continue;
    if (family == AF_INET)
      found = std::memcmp(&reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, addr, sizeof(in_addr)) == 0;
    else
      found = std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, addr, sizeof(in6_addr)) == 0;
  }
  freeifaddrs(list);
  return found;
}

}  // namespace

bool endpoint_is_on_this_host(const std::string& endpoint) {
  const std::string host = tcp_host(endpoint);
  if (host.empty()) return false;
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1)
    return (ntohl(v4.s_addr) >> 24) == 127 || is_own_address(AF_INET, &v4);
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1)
    return IN6_IS_ADDR_LOOPBACK(&v6) || is_own_address(AF_INET6, &v6);
  return false;
}

}  // namespace xd::detail
