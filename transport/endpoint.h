// TCP endpoint strings, "tcp://host:port" or "tcp://[v6]:port": their host,
// the same endpoint with another host, and whether a host is a loopback name.
// Plain functions; no DNS.
#pragma once

#include <string>

namespace xd {

// "tcp://10.0.0.1:41234" -> "10.0.0.1"; "" when not a TCP endpoint.
std::string endpoint_host(const std::string& endpoint);

// "tcp://0.0.0.0:41234" with "node-a" -> "tcp://node-a:41234"; a non-TCP
// endpoint comes back unchanged.
std::string endpoint_with_host(const std::string& endpoint, const std::string& host);

// "localhost", 127.0.0.0/8 or ::1.
bool is_loopback_host(const std::string& host);

}  // namespace xd
