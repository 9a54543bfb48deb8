// One zstd compression and one decompression context per thread, reused, so
// a tensor pays for no context's allocation and table set-up. The frames are
// those of ZSTD_compress and ZSTD_decompress (the same parameters). A context
// is null when zstd could not allocate it. Each thread owns its pair.
#pragma once

#include <zstd.h>

namespace xd::detail {

struct ZstdContexts {
  ZSTD_CCtx* compress = ZSTD_createCCtx();
  ZSTD_DCtx* decompress = ZSTD_createDCtx();
  ZstdContexts() = default;
  ZstdContexts(const ZstdContexts&) = delete;
  ZstdContexts& operator=(const ZstdContexts&) = delete;
  ~ZstdContexts() {
    ZSTD_freeCCtx(compress);
    ZSTD_freeDCtx(decompress);
  }
};

// The calling thread's pair.
ZstdContexts& zstd_contexts();

}  // namespace xd::detail
