// CURVE security for every socket (ZeroMQ's CurveZMQ: Curve25519 keys,
// encrypted and authenticated links) and the allow-lists its ZAP handler
// checks. Keys are Z85 text, 40 characters. A key file holds
//   public-key = "<Z85>"
//   secret-key = "<Z85>"      (secret files only; mode 0600)
// in the layout of ZeroMQ's zcert files, so `xdmoe keygen` output reads like
// theirs. Secret keys never reach a log or a status reply; public keys are
// shown as their first 8 characters.
//
// Allow-lists are per ZAP domain ("control": workers registering with the
// coordinator; "cli": `xdmoe status/stop/...`; "data": workers' data links)
// and process-wide; set_allowed_keys and refusals are thread-safe. A client
// of a domain that has no allow-list yet waits up to 10 s for one (a worker
// learns its peers' keys from its assignment, which a peer may have got
// first), then is refused.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace xd {

inline constexpr const char* kZapDomainControl = "control";
inline constexpr const char* kZapDomainCli = "cli";
inline constexpr const char* kZapDomainData = "data";

struct CurveKeys {
  std::string public_key;  // Z85
  std::string secret_key;  // Z85; empty for a public key alone
};

// How one socket speaks: plaintext, or CURVE with this process's keys. A
// client also names the server's public key; a server the ZAP domain whose
// allow-list admits its clients.
struct SocketSecurity {
  bool curve = false;
  CurveKeys own;
  std::string server_public_key;  // clients only
  std::string zap_domain;         // servers only
};

bool curve_available();  // libzmq built with CURVE (libsodium)
Expected<CurveKeys> generate_curve_keys();
// Writes <dir>/<name>.key (both keys, mode 0600) and <dir>/<name>.pub
// (public key, 0644); refuses to overwrite either.
Status write_curve_key_files(const std::string& dir, const std::string& name, const CurveKeys& keys);
// A .key file; refuses one that others may read (mode & 077).
Expected<CurveKeys> read_secret_key_file(const std::string& path);
// A .key or .pub file, or a Z85 key written out.
Expected<std::string> read_public_key(const std::string& file_or_key);
// "rq:rM>}U...": what logs and status show of a public key.
std::string key_label(const std::string& public_key);

// Which client keys a domain admits. `any_key`: every CURVE client is
// admitted (still encrypted; its key is what the server sees as its user).
void set_allowed_keys(const std::string& domain, const std::vector<std::string>& public_keys, bool any_key = false);
// Whether `public_key` is on `domain`'s list (not just admitted by any_key).
bool key_is_allowed(const std::string& domain, const std::string& public_key);

struct Refusal {
  std::string domain, address, key;  // key: key_label of the client's public key
  double unix_s = 0;
};
// Every client refused so far in this process (the newest 100).
std::vector<Refusal> refusals();

}  // namespace xd
