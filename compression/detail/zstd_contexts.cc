#include "compression/detail/zstd_contexts.h"

namespace xd::detail {

ZstdContexts& zstd_contexts() {
  thread_local ZstdContexts contexts;
  return contexts;
}

}  // namespace xd::detail
