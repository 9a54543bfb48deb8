#include "model/expert_exchange.h"

#include <numeric>

#include "common/check.h"

namespace xd {

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
  XD_CHECK(counts.size() == experts_.size());
  XD_CHECK((int64_t)rows.size() == std::accumulate(counts.begin(), counts.end(), int64_t{0}) * width);
  XD_CHECK_MSG(pending_.emplace(tag, Pending{std::move(rows), counts}).second, "exchange started twice");
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
void LocalExpertExchange<T>::start_to_sources(const ExchangeTag& tag, std::vector<T> rows, int) {
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
