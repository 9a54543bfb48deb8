#include "model/expert_exchange.h"

#include <numeric>

#include "common/check.h"

namespace xd {

namespace {

// A backward exchange of span s: rows in chunk order ((chunk, expert) blocks
// with counts[c * E + e] rows each) to expert order ((expert, chunk) blocks),
// or back (`to_expert_order` false).
template <typename T>
std::vector<T> reorder_span(const std::vector<T>& rows, const std::vector<int>& counts, int num_experts, int width,
                            bool to_expert_order) {
  const int span = static_cast<int>(counts.size()) / num_experts;
  std::vector<size_t> chunk_major(counts.size()), expert_major(counts.size());
  size_t row = 0;
  for (int c = 0; c < span; ++c)
    for (int e = 0; e < num_experts; ++e) chunk_major[c * num_experts + e] = row, row += counts[c * num_experts + e];
  row = 0;
  for (int e = 0; e < num_experts; ++e)
    for (int c = 0; c < span; ++c) expert_major[c * num_experts + e] = row, row += counts[c * num_experts + e];
  XD_CHECK(rows.size() == row * width);
  std::vector<T> out(rows.size());
  for (size_t b = 0; b < counts.size(); ++b) {
    const size_t from = to_expert_order ? chunk_major[b] : expert_major[b];
    const size_t to = to_expert_order ? expert_major[b] : chunk_major[b];
    std::copy(rows.begin() + from * width, rows.begin() + (from + counts[b]) * width, out.begin() + to * width);
  }
  return out;
}

}  // namespace

template <typename T>
void ExpertExchange<T>::to_experts(const ExchangeTag& tag, const T* rows, const std::vector<int>& counts, int width,
                                   std::vector<T>* out, std::vector<int>* out_counts) {
  const int64_t n = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  start_to_experts(tag, std::vector<T>(rows, rows + n * width), counts, width);
  finish_to_experts(tag, out, out_counts);
}

template <typename T>
void ExpertExchange<T>::to_sources(const ExchangeTag& tag, const T* rows, size_t num_rows, int width,
                                   std::vector<T>* out) {
  start_to_sources(tag, std::vector<T>(rows, rows + num_rows * width), width);
  finish_to_sources(tag, out);
}

template <typename T>
LocalExpertExchange<T>::LocalExpertExchange(int num_experts) : experts_(num_experts) {
  std::iota(experts_.begin(), experts_.end(), 0);
}

template <typename T>
void LocalExpertExchange<T>::start_to_experts(const ExchangeTag& tag, std::vector<T> rows,
                                              const std::vector<int>& counts, int width) {
  const int E = static_cast<int>(experts_.size());
  XD_CHECK(tag.span >= 1 && counts.size() == (size_t)E * tag.span);
  XD_CHECK((int64_t)rows.size() == std::accumulate(counts.begin(), counts.end(), int64_t{0}) * width);
  if (observer_) observer_(tag, rows, counts);
  Pending p{std::move(rows), counts};
  if (tag.span > 1) {
    p.rows = reorder_span(p.rows, counts, E, width, true);
    p.counts.assign(E, 0);
    for (size_t b = 0; b < counts.size(); ++b) p.counts[b % E] += counts[b];
    span_counts_[{tag.layer, tag.chunk}] = counts;
  }
  XD_CHECK_MSG(pending_.emplace(tag, std::move(p)).second, "exchange started twice");
}

template <typename T>
void LocalExpertExchange<T>::finish_to_experts(const ExchangeTag& tag, std::vector<T>* out,
                                               std::vector<int>* out_counts) {
  auto it = pending_.find(tag);
  XD_CHECK_MSG(it != pending_.end(), "finishing an exchange that was not started");
  *out = std::move(it->second.rows);
  *out_counts = std::move(it->second.counts);
  pending_.erase(it);
}

template <typename T>
void LocalExpertExchange<T>::start_to_sources(const ExchangeTag& tag, std::vector<T> rows, int width) {
  if (tag.span > 1) {
    auto it = span_counts_.find({tag.layer, tag.chunk});
    XD_CHECK_MSG(it != span_counts_.end() && it->second.size() == experts_.size() * tag.span,
                 "rows sent back without their backward of Combine");
    rows = reorder_span(rows, it->second, static_cast<int>(experts_.size()), width, false);
  }
  XD_CHECK_MSG(pending_.emplace(tag, Pending{std::move(rows), {}}).second, "exchange started twice");
}

template <typename T>
void LocalExpertExchange<T>::finish_to_sources(const ExchangeTag& tag, std::vector<T>* out) {
  auto it = pending_.find(tag);
  XD_CHECK_MSG(it != pending_.end(), "finishing an exchange that was not started");
  *out = std::move(it->second.rows);
  pending_.erase(it);
}

template class ExpertExchange<float>;
template class ExpertExchange<double>;
template class LocalExpertExchange<float>;
template class LocalExpertExchange<double>;

}  // namespace xd
