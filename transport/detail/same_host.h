// endpoint_is_on_this_host: whether a ZeroMQ TCP endpoint names this machine,
// so that its traffic goes over the loopback device and both ends share this
// host's cores. True for "localhost", 127.0.0.0/8, ::1 and any address of
// this host's network interfaces. Host names other than "localhost" are not
// resolved (no DNS on the connect path) and count as remote, as do non-TCP
// and malformed endpoints: the safe answer, since remote links keep the
// kernel's defaults. Thread-safe.
#pragma once

#include <string>

namespace xd::detail {

bool endpoint_is_on_this_host(const std::string& endpoint);

}  // namespace xd::detail
