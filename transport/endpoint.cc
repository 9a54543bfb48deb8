#include "transport/endpoint.h"

#include <cctype>

namespace xd {

namespace {
constexpr char kScheme[] = "tcp://";
constexpr size_t kSchemeSize = sizeof kScheme - 1;

// [begin, end) of the host inside a TCP endpoint, brackets excluded; false if none.
bool host_span(const std::string& endpoint, size_t* begin, size_t* end) {
  if (endpoint.compare(0, kSchemeSize, kScheme) != 0) return false;
  if (endpoint.size() > kSchemeSize && endpoint[kSchemeSize] == '[') {
    const size_t close = endpoint.find(']', kSchemeSize);
    // "[v6]:port": the port's colon right after the bracket.
    if (close == std::string::npos || close + 1 >= endpoint.size() || endpoint[close + 1] != ':') return false;
    *begin = kSchemeSize + 1;
    *end = close;
    return true;
  }
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon < kSchemeSize) return false;
  *begin = kSchemeSize;
  *end = colon;
  return true;
}
}  // namespace

std::string endpoint_host(const std::string& endpoint) {
  size_t b = 0, e = 0;
  return host_span(endpoint, &b, &e) ? endpoint.substr(b, e - b) : "";
}

std::string endpoint_with_host(const std::string& endpoint, const std::string& host) {
  size_t b = 0, e = 0;
  if (!host_span(endpoint, &b, &e)) return endpoint;
  std::string bare = host;  // "[::1]" and "::1" alike
  if (bare.size() > 1 && bare.front() == '[' && bare.back() == ']') bare = bare.substr(1, bare.size() - 2);
  const bool v6 = bare.find(':') != std::string::npos;
  const size_t port = endpoint.rfind(':');
  return std::string(kScheme) + (v6 ? "[" + bare + "]" : bare) + endpoint.substr(port);
}

bool is_loopback_host(const std::string& host) {
  std::string h;
  for (char c : host) h += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return h == "localhost" || h.rfind("127.", 0) == 0 || h == "::1" || h == "[::1]" || h.rfind("::ffff:127.", 0) == 0;
}

}  // namespace xd
