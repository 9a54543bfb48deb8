#include "transport/detail/same_host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstring>

#include "transport/endpoint.h"

namespace xd::detail {
namespace {

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
  const std::string host = endpoint_host(endpoint);
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
