#include "model/byte_tokenizer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace xd {

Expected<std::vector<int32_t>> ByteTokenizer::encode_file(const std::string& path) {
  // stdio rather than ifstream: ferror/errno tell a directory or a failing disk
  // apart from an empty file, which istreambuf_iterator silently cannot.
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return Status::io_error("cannot open '" + path + "': " + std::strerror(errno));
  }
  std::string bytes;
  char buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) bytes.append(buffer, got);
  const bool read_failed = std::ferror(file) != 0;
  const int read_errno = errno;
  std::fclose(file);
  if (read_failed) {
    return Status::io_error("failed reading '" + path + "': " + std::strerror(read_errno));
  }
  if (bytes.empty()) {
    return Status::invalid_argument("'" + path + "' is empty: nothing to train on");
  }
  return encode(bytes);
}

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<int32_t> tokens;
  tokens.reserve(text.size());
  // Through unsigned char so bytes >= 0x80 become 128..255, not negative ids.
  for (char c : text) tokens.push_back(static_cast<unsigned char>(c));
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (int32_t t : tokens) {
    text.push_back(t >= 0 && t < kVocabSize ? static_cast<char>(static_cast<unsigned char>(t))
                                            : '?');
  }
  return text;
}

}  // namespace xd
