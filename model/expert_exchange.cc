#include "model/expert_exchange.h"

#include <numeric>

#include "common/check.h"

namespace xd {

template <typename T>
LocalExpertExchange<T>::LocalExpertExchange(int num_experts) : experts_(num_experts) {
  std::iota(experts_.begin(), experts_.end(), 0);
}

template <typename T>
void LocalExpertExchange<T>::to_experts(const ExchangeTag& tag, const T* rows,
                                        const std::vector<int>& counts, int width,
                                        std::vector<T>* out, std::vector<int>* out_counts) {
  XD_CHECK(counts.size() == experts_.size());
  int64_t n = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if ((int)rows_by_layer_.size() <= tag.layer) rows_by_layer_.resize(tag.layer + 1, 0);
  rows_by_layer_[tag.layer] = n;
  out->assign(rows, rows + n * width);
  *out_counts = counts;
}

template <typename T>
void LocalExpertExchange<T>::to_sources(const ExchangeTag& tag, const T* rows, int width,
                                        std::vector<T>* out) {
  XD_CHECK(tag.layer < (int)rows_by_layer_.size());
  out->assign(rows, rows + rows_by_layer_[tag.layer] * width);
}

template class LocalExpertExchange<float>;
template class LocalExpertExchange<double>;

}  // namespace xd
