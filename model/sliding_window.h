// Sliding-window evaluation: scores a token sequence of any length with a
// model that sees at most `window` tokens at once, the way perplexity is
// usually evaluated. Windows of `window` tokens start every `stride` tokens
// (the last one ends at the final token); each window scores only the targets
// no earlier window scored, so every token after the first is scored exactly
// once, with at least window - stride tokens of context (all of them in the
// first window). A sequence that fits one window is one plain forward.
// Not thread-safe (it runs the given model).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "model/moe_transformer.h"

namespace xd {

struct SlidingWindowOptions {
  int window = 0;  // tokens per forward; 0: the model's max_seq_len
  int stride = 0;  // tokens between window starts, 1..window-1; 0: window / 2 (at least 1)
};

struct SlidingWindowResult {
  // (T, V): row t holds the logits predicting token t + 1, from the window
  // that scored it (the last row: from the last window).
  std::vector<float> logits;
  double mean_ce = 0;  // mean next-token cross entropy over the T - 1 targets, nats
  int window = 0, stride = 0;  // as used
  int windows = 0;             // forwards run
};

// Errors: an empty sequence, a window above max_seq_len or below 2, a stride
// outside 1..window-1 (a window's first token has no context inside it, so
// windows must overlap), a token outside the vocabulary.
Expected<SlidingWindowResult> evaluate_sliding_window(MoeTransformer<float>& model,
                                                      const std::vector<int32_t>& tokens,
                                                      const SlidingWindowOptions& options = {});

}  // namespace xd
