#include "model/sliding_window.h"

#include <algorithm>
#include <string>

#include "model/ops.h"

namespace xd {

Expected<SlidingWindowResult> evaluate_sliding_window(MoeTransformer<float>& model,
                                                      const std::vector<int32_t>& tokens,
                                                      const SlidingWindowOptions& options) {
  const ModelConfig& cfg = model.config();
  const int T = static_cast<int>(tokens.size()), V = cfg.vocab_size;
  if (T == 0) return Status::invalid_argument("no tokens to evaluate");
  SlidingWindowResult r;
  r.window = options.window > 0 ? options.window : cfg.max_seq_len;
  if (r.window > cfg.max_seq_len)
    return Status::invalid_argument("window " + std::to_string(r.window) + " is longer than the model's max_seq_len " +
                                    std::to_string(cfg.max_seq_len));
  // A window's first token has no context inside it, so consecutive windows
  // must overlap by at least one token for every target to be scored.
  if (r.window < 2 && T > 1) return Status::invalid_argument("window must be at least 2 tokens");
  r.stride = options.stride > 0 ? options.stride : std::max(1, r.window / 2);
  if (options.stride < 0 || (r.stride >= r.window && T > r.window))
    return Status::invalid_argument("stride must be in 1..window-1 (" + std::to_string(r.window - 1) +
                                    "): consecutive windows must overlap");
  for (int32_t t : tokens)
    if (t < 0 || t >= V) return Status::invalid_argument("token " + std::to_string(t) + " is outside the vocabulary");

  const int W = std::min(r.window, T);
  r.logits.assign(static_cast<size_t>(T) * V, 0.0f);
  double ce_sum = 0;
  int scored_until = 1;  // targets [1, scored_until) are scored
  for (int start = 0;; start += r.stride) {
    const int begin = std::min(start, T - W), end = begin + W;
    model.forward(tokens.data() + begin, nullptr, 1, W);
    const std::vector<float>& logits = model.logits();
    // Targets [scored_until, end): target j is predicted by window row j - 1 - begin.
    const int first_row = scored_until - 1 - begin, n = end - scored_until;
    if (n > 0)
      ce_sum += n * cross_entropy_forward_backward<float>(nullptr, logits.data() + size_t(first_row) * V,
                                                          tokens.data() + scored_until, n, V, 1.0);
    std::copy(logits.begin() + size_t(std::max(first_row, 0)) * V, logits.begin() + size_t(W) * V,
              r.logits.begin() + size_t(begin + std::max(first_row, 0)) * V);
    scored_until = end;
    ++r.windows;
    if (end == T) break;
  }
  r.mean_ce = T > 1 ? ce_sum / (T - 1) : 0.0;
  return r;
}

}  // namespace xd
