#include "transport/security.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <zmq.h>

#include "common/atomic_file.h"

namespace xd {

namespace {

bool is_z85_key(const std::string& s) {
  if (s.size() != 40) return false;
  uint8_t bin[32];
  return zmq_z85_decode(bin, s.c_str()) != nullptr;
}

// The value of `name = "..."` in a key file, or empty.
std::string key_field(const std::string& text, const std::string& name) {
  std::smatch m;
  if (std::regex_search(text, m, std::regex(name + "\\s*=\\s*\"([^\"]{40})\""))) return m[1];
  return "";
}

}  // namespace

bool curve_available() { return zmq_has("curve") != 0; }

Expected<CurveKeys> generate_curve_keys() {
  if (!curve_available()) return Status::unavailable("this libzmq has no CURVE support (built without libsodium)");
  char pub[41] = {0}, sec[41] = {0};
  if (zmq_curve_keypair(pub, sec) != 0) return Status::internal(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
  return CurveKeys{pub, sec};
}

Status write_curve_key_files(const std::string& dir, const std::string& name, const CurveKeys& keys) {
  namespace fs = std::filesystem;
  if (name.empty() || name.find('/') != std::string::npos) return Status::invalid_argument("bad key name '" + name + "'");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::io_error("cannot create " + dir + ": " + ec.message());
  const std::string secret = dir + "/" + name + ".key", pub = dir + "/" + name + ".pub";
  for (const std::string& p : {secret, pub})
    if (fs::exists(p, ec)) return Status::invalid_argument(p + " exists; keys are never overwritten (remove it first)");
  const std::string head = "#   xdmoe CURVE key pair '" + name + "' (ZeroMQ zcert layout)\ncurve\n";
  const std::string pub_text = head + "    public-key = \"" + keys.public_key + "\"\n";
  const std::string secret_text = pub_text + "    secret-key = \"" + keys.secret_key + "\"\n";
  // The secret file is born private: created 0600 before a byte is written.
  const mode_t old = ::umask(077);
  Status st = write_file_atomic(secret, secret_text.data(), secret_text.size());
  ::umask(old);
  XD_RETURN_IF_ERROR(st);
  if (::chmod(secret.c_str(), 0600) != 0) return Status::io_error("cannot chmod 0600 " + secret);
  XD_RETURN_IF_ERROR(write_file_atomic(pub, pub_text.data(), pub_text.size()));
  ::chmod(pub.c_str(), 0644);
  return Status::ok();
}

Expected<CurveKeys> read_secret_key_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::not_found("no key file " + path);
  if (st.st_mode & 077)
    return Status::invalid_argument(path + " may be read by others (mode " + [&] {
      char b[8];
      std::snprintf(b, sizeof b, "%04o", st.st_mode & 07777);
      return std::string(b);
    }() + "): chmod 600 it");
  auto text = read_file(path);
  if (!text) return text.status();
  CurveKeys k{key_field(*text, "public-key"), key_field(*text, "secret-key")};
  if (!is_z85_key(k.public_key) || !is_z85_key(k.secret_key))
    return Status::invalid_argument(path + ": not a secret key file (public-key and secret-key, 40 Z85 characters each)");
  return k;
}

Expected<std::string> read_public_key(const std::string& file_or_key) {
  if (is_z85_key(file_or_key)) return file_or_key;
  auto text = read_file(file_or_key);
  if (!text)
    return Status::not_found((file_or_key.size() == 40 ? key_label(file_or_key) : file_or_key) +
                             " is neither a Z85 public key nor a readable key file");
  const std::string k = key_field(*text, "public-key");
  if (!is_z85_key(k)) return Status::invalid_argument(file_or_key + ": no public-key = \"<40 Z85 characters>\"");
  return k;
}

std::string key_label(const std::string& public_key) { return public_key.substr(0, 8) + "..."; }

}  // namespace xd
