// ByteTokenizer: the identity map between bytes and token ids (vocab 256).
// Stateless, so every member is static and safe to call from any thread.
// encode() never fails; encode_file() reports unreadable or empty files as a
// Status so a bad --data path turns into a message, not an abort. decode()
// accepts any id and renders ids outside 0..255 (e.g. from an untrained model's
// sampler with a larger vocab) as '?', so it is safe on arbitrary output.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace xd {

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;

  // io_error naming the path when it cannot be read; invalid_argument when empty.
  static Expected<std::vector<int32_t>> encode_file(const std::string& path);
  static std::vector<int32_t> encode(std::string_view text);
  static std::string decode(const std::vector<int32_t>& tokens);
};

}  // namespace xd
