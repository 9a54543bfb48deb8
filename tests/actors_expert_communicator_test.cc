// The HybridEP replica-gradient return over two levels of replicas (domains
// 2 x 2), on four in-process workers over loopback: every layer's outer-level
// messages leave before the owned experts' gradients are final (one layer's
// wait for them holds up no other's), and once they are, every owned
// gradient holds every holder's share, summed in the simple schedule's order.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "actors/expert_communicator.h"
#include "local_transports.h"
#include "model/param_layout.h"

namespace xd {
namespace {

constexpr int kWorld = 4;

ModelConfig tiny_model() {
  ModelConfig c;
  c.hidden_size = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 8;
  c.num_experts = kWorld;  // one per worker
  c.top_k = 2;
  c.expert_intermediate_size = 4;
  c.num_shared_experts = 0;
  return c;
}

// Rank r's share of layer l's expert e's gradient, element k: magnitudes
// 256 times apart from rank to rank, so that float sums in another order
// round differently.
float share(int rank, int layer, int expert, size_t k) {
  return std::ldexp(float(1.0 + 0.1234567 * double(k + 1) + 0.01 * layer + 0.001 * expert), 8 * rank);
}

// Ranks are (dc, worker) with the worker coordinate inner: r's inner peer is
// r ^ 1, its outer peer r ^ 2. The simple schedule's sum for r's own expert:
// its own share, plus its inner peer's, plus what its outer peer sends, the
// outer peer's share plus that one's inner peer's.
float simple_sum(float own, int r, int layer, size_t k) {
  const int inner = r ^ 1, outer = r ^ 2, outer_inner = r ^ 3;
  const float from_outer = share(outer, layer, r, k) + share(outer_inner, layer, r, k);
  return (own + share(inner, layer, r, k)) + from_outer;
}

struct Worker {
  std::unique_ptr<ParamLayout> layout;
  std::unique_ptr<MoeTransformer<float>> model;
  std::unique_ptr<ExpertCommunicator> comm;
};

TEST(ExpertCommunicator, WithTwoLevelsTheOuterGradientsLeaveBeforeTheOwnedOnesAreFinal) {
  const ModelConfig mc = tiny_model();
  ASSERT_TRUE(mc.validate().is_ok());
  auto transports = testing::local_transports(kWorld);
  const size_t floats = (size_t)mc.expert_intermediate_size * mc.hidden_size;
  std::vector<Worker> workers(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    Worker& w = workers[r];
    w.layout = std::make_unique<ParamLayout>(mc, r, 1);
    w.model = std::make_unique<MoeTransformer<float>>(*w.layout);
    w.comm = std::make_unique<ExpertCommunicator>(transports[r].get(), Topology({2, 2}, {2, 2}), w.model.get(),
                                                  std::chrono::seconds(20));
    ASSERT_TRUE(w.comm->holds_replicas());
    w.comm->zero_replica_grads();  // the owned experts' gradients are being written from now on
    // Each worker's share of every expert's gradient: its own expert in the
    // model, the three others in its replicas.
    for (int layer = 0; layer < mc.num_layers; ++layer) {
      const LayerWeights<float>& g = w.model->grad_weights().layers[layer];
      for (size_t k = 0; k < floats; ++k) g.w1[k] = g.w3[k] = g.w2[k] = 0.0f;  // still being computed
      for (int e = 0; e < kWorld; ++e) {
        if (e == r) continue;
        ExpertParams<float> p = w.comm->replica(layer, e);
        for (size_t k = 0; k < floats; ++k) p.dw1[k] = p.dw3[k] = p.dw2[k] = share(r, layer, e, k);
      }
    }
  }
  // As backward finishes them: the last layer first.
  for (Worker& w : workers) w.comm->start_reduce(0, 1);
  for (Worker& w : workers) w.comm->start_reduce(0, 0);
  // Every worker gets its inner peer's message and its outer peer's of both
  // layers, though no worker has said its owned gradients are final: the
  // outer peer's leave with the inner level's share of its owned experts
  // held back.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int r = 0; r < kWorld; ++r) {
    while (transports[r]->stats().messages_received_by_kind[(int)MessageKind::kExpertGrad] < 4 &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(transports[r]->stats().messages_received_by_kind[(int)MessageKind::kExpertGrad], 4u)
        << "rank " << r << ": the outer level's gradients waited for the owned experts'";
  }
  // Only now does the compute thread write the owned experts' own gradients
  // (the overlapped schedule's deferred ones): nothing received may have been
  // added into them before.
  for (int r = 0; r < kWorld; ++r)
    for (int layer = 0; layer < mc.num_layers; ++layer) {
      const LayerWeights<float>& g = workers[r].model->grad_weights().layers[layer];
      for (size_t k = 0; k < floats; ++k) g.w1[k] = g.w3[k] = g.w2[k] = share(r, layer, r, k);
    }
  for (Worker& w : workers)
    for (int layer = 0; layer < mc.num_layers; ++layer) w.comm->owned_grads_final(layer);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(workers[r].comm->wait_reduced().is_ok()) << workers[r].comm->status().to_string();
    for (int layer = 0; layer < mc.num_layers; ++layer) {
      const LayerWeights<float>& g = workers[r].model->grad_weights().layers[layer];
      for (size_t k = 0; k < floats; ++k) {
        const float all = simple_sum(share(r, layer, r, k), r, layer, k);
        ASSERT_EQ(g.w1[k], all) << "rank " << r << " layer " << layer << " element " << k;
        ASSERT_EQ(g.w3[k], all) << "rank " << r << " layer " << layer << " element " << k;
        ASSERT_EQ(g.w2[k], all) << "rank " << r << " layer " << layer << " element " << k;
      }
    }
  }
}

}  // namespace
}  // namespace xd
