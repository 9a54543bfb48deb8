// The networked Dispatch/Combine in one process: G Transports over loopback,
// one thread per worker. Rows carry (source, expert, index) so every hop can
// be checked, including workers that route nothing at all.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "actors/hybrid_exchange.h"
#include "common/rng.h"
#include "local_transports.h"

namespace xd {
namespace {

struct Cluster {
  std::vector<std::unique_ptr<Transport>> transports;
  explicit Cluster(int world) : transports(testing::local_transports(world)) {}
};

// counts[rank][expert]: some experts empty everywhere, one rank sends nothing.
std::vector<std::vector<int>> make_counts(int world, int experts, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<int>> c(world, std::vector<int>(experts, 0));
  for (int r = 0; r < world; ++r)
    for (int e = 0; e < experts; ++e) {
      if (r == 1) continue;            // a worker with no tokens at all
      if (e == experts - 1) continue;  // an expert nobody routes to
      c[r][e] = rng.next_u64() % 3 == 0 ? 0 : 1 + rng.next_u64() % 5;
    }
  return c;
}

// `codec`: the pipeline every row takes to every peer ("" sends raw). The
// rows hold small integers, which fp16 and bf16 carry exactly.
void run_round_trip(const std::vector<int>& levels, const std::vector<int>& domains, bool flat,
                    const std::string& codec = "") {
  const int world = levels.size() == 1 ? levels[0] : levels[0] * levels[1];
  const int experts = world * 2, width = 3;
  Cluster cluster(world);
  auto counts = make_counts(world, experts, 99);
  std::vector<std::string> failures(world);
  std::vector<int> received_rows(world, 0);
  std::vector<double> raw_toward_experts(world, 0), raw_toward_sources(world, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      Topology topo = flat ? Topology({world}, {1}) : Topology(levels, domains);
      HybridExpertExchange ex(cluster.transports[r].get(), topo, experts, std::chrono::seconds(20));
      ex.set_step(7);
      if (!codec.empty()) {
        std::vector<CodecPipeline> every(world, *CodecPipeline::parse(codec));
        ex.set_codecs(every, every);
      }
      std::vector<float> rows;
      for (int e = 0; e < experts; ++e)
        for (int k = 0; k < counts[r][e]; ++k) rows.insert(rows.end(), {(float)r, (float)e, (float)k});
      std::vector<float> at_experts, back;
      std::vector<int> out_counts;
      ex.to_experts({3, (int)ExchangePhase::kDispatch}, rows.data(), counts[r], width, &at_experts, &out_counts);
      std::string& err = failures[r];
      if (!ex.status().is_ok()) { err = ex.status().to_string(); return; }
      // Every row sits with its expert, grouped in computed_experts() order.
      size_t row = 0;
      const auto& computed = ex.computed_experts();
      for (size_t j = 0; j < computed.size(); ++j)
        for (int k = 0; k < out_counts[j]; ++k, ++row)
          if ((int)at_experts[row * width + 1] != computed[j]) err = "row of expert " + std::to_string((int)at_experts[row * width + 1]) + " in the group of " + std::to_string(computed[j]);
      received_rows[r] = (int)row;
      // The experts "compute": double the row; Combine brings it home.
      for (float& v : at_experts) v = 2 * v + 1;
      ex.to_sources({3, (int)ExchangePhase::kCombine}, at_experts.data(), at_experts.size() / width, width, &back);
      if (!ex.status().is_ok()) { err = ex.status().to_string(); return; }
      if (back.size() != rows.size()) { err = "combine returned " + std::to_string(back.size()) + " values"; return; }
      for (size_t i = 0; i < rows.size(); ++i)
        if (back[i] != 2 * rows[i] + 1) { err = "combine lost the row order at " + std::to_string(i); return; }
      // Backward: the same route again, then back.
      ex.to_experts({3, (int)ExchangePhase::kCombineBackward}, rows.data(), counts[r], width, &at_experts, &out_counts);
      ex.to_sources({3, (int)ExchangePhase::kDispatchBackward}, at_experts.data(), at_experts.size() / width, width,
                   &back);
      if (!ex.status().is_ok() || back != rows) err = "backward round trip changed the rows";
      for (const TokenCodecFigures& f : ex.take_token_figures()) {
        raw_toward_experts[r] += f.raw_bytes[0];
        raw_toward_sources[r] += f.raw_bytes[1];
      }
    });
  for (auto& t : threads) t.join();
  int sent = 0, got = 0;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(failures[r], "") << "rank " << r;
    for (int c : counts[r]) sent += c;
    got += received_rows[r];
  }
  EXPECT_EQ(sent, got);
  // Every row that left toward the experts came back along the same route.
  double out = 0, back = 0;
  for (int r = 0; r < world; ++r) out += raw_toward_experts[r], back += raw_toward_sources[r];
  EXPECT_EQ(out, back);
  if (!flat && domains == levels) EXPECT_EQ(out, 0) << "every expert gathered: no token moves";
  else EXPECT_GT(out, 0);
  EXPECT_EQ(received_rows.size(), (size_t)world);
}

TEST(HybridExchange, FlatEpDeliversEveryRowToItsOwnerAndBackWithEmptyWorkersAndExperts) {
  run_round_trip({4}, {1}, true);
}

TEST(HybridExchange, HierarchicalEpRoundTripsOnTwoLevels) { run_round_trip({2, 2}, {1, 1}, false); }

TEST(HybridExchange, EveryDomainChoiceOfFourByTwoRoundTrips) {
  for (int s0 : {1, 2, 4})
    for (int s1 : {1, 2}) {
      SCOPED_TRACE("domains " + std::to_string(s0) + "x" + std::to_string(s1));
      run_round_trip({4, 2}, {s0, s1}, false);
    }
}

TEST(HybridExchange, CompressedRowsTravelWithTheirCodecAndArriveIntact) {
  run_round_trip({2, 2}, {1, 1}, false, "fp16+zstd:1");
  run_round_trip({4}, {1}, true, "bf16");
}

// A peer whose compressed rows do not add up -- a payload one byte short,
// rows of another width, a record that is not a codec record, a claim of a
// billion rows (refused before anything is allocated for them) -- fails the
// exchange with a Status naming the peer, never a crash.
TEST(HybridExchange, ACorruptCompressedMessageFailsTheExchangeWithAStatus) {
  const std::vector<float> two_rows = {1, 2, 3, 4, 5, 6};
  auto corrupt = [&](const char* what) -> std::pair<std::string, std::vector<uint8_t>> {
    EncodedTensor e;
    const bool wide = std::string(what) == "wrong width";
    std::vector<float> rows = two_rows;
    if (wide) rows.resize(10, 0.5f);
    XD_CHECK(CodecPipeline::parse("bf16")->encode(rows.data(), {2, wide ? 5u : 3u}, &e).is_ok());
    if (std::string(what) == "short payload") e.payload.pop_back();
    if (std::string(what) == "not a record") e.metadata = std::string("\x81\xa1x\x01", 4);  // {"x": 1}
    if (std::string(what) == "a billion rows") {  // rows: 2 -> 2^30, as a msgpack u32
      const size_t at = e.metadata.find("rows") + 4;
      e.metadata.replace(at, 1, std::string("\xce\x40\x00\x00\x00", 5));
    }
    return {e.metadata, e.payload};
  };
  for (const char* what : {"short payload", "wrong width", "not a record", "a billion rows"}) {
    Cluster cluster(2);
    HybridExpertExchange ex(cluster.transports[0].get(), Topology({2}, {1}), 4, std::chrono::seconds(10));
    // Rank 1, played here, sends rank 0 its two dispatch rows, corrupted.
    auto [meta, payload] = corrupt(what);
    const int32_t ids[2] = {0, 1};
    cluster.transports[1]->send(0, Tag{MessageKind::kMoeDispatch, 0, 0, (uint16_t)ExchangePhase::kDispatch, 0},
                                {OutFrame::copy_of(ids, sizeof ids), OutFrame::copy_of(payload.data(), payload.size())},
                                meta, kFlagCompressed);
    std::vector<float> rows(4 * 3, 1.0f), out;
    std::vector<int> counts = {1, 1, 1, 1}, out_counts;
    ex.to_experts({0, (int)ExchangePhase::kDispatch}, rows.data(), counts, 3, &out, &out_counts);
    EXPECT_FALSE(ex.status().is_ok()) << what;
    EXPECT_NE(ex.status().code(), Status::Code::kTimeout) << what << ": refused at once, not waited out";
    std::printf("[exchange] %s: %s\n", what, ex.status().message().c_str());
    EXPECT_NE(ex.status().message().find("from rank 1"), std::string::npos) << what << ": " << ex.status().message();
    EXPECT_EQ(out_counts.size(), ex.computed_experts().size()) << "shapes stay consistent";
  }
}

TEST(HybridExchange, WorkersComputeExactlyTheExpertsOfTheirDomains) {
  Cluster cluster(4);
  HybridExpertExchange ep(cluster.transports[3].get(), Topology({2, 2}, {1, 1}), 8);
  EXPECT_EQ(ep.computed_experts(), (std::vector<int>{6, 7}));
  HybridExpertExchange inner(cluster.transports[3].get(), Topology({2, 2}, {1, 2}), 8);
  EXPECT_EQ(inner.computed_experts(), (std::vector<int>{4, 5, 6, 7}));
  HybridExpertExchange all(cluster.transports[3].get(), Topology({2, 2}, {2, 2}), 8);
  EXPECT_EQ(all.computed_experts().size(), 8u);
}

TEST(HybridExchange, WhenEveryExpertIsHeldHereTheRowsArriveInTheirOwnBufferUncopied) {
  // Domains spanning both levels: no row leaves, and every hop, the grouping
  // by expert and the way back hand the caller's buffer on.
  Cluster cluster(8);
  HybridExpertExchange ex(cluster.transports[5].get(), Topology({4, 2}, {4, 2}), 16);
  const int width = 3;
  std::vector<int> counts(16, 0);
  counts[2] = 2, counts[9] = 1, counts[15] = 3;
  std::vector<float> rows;
  for (int e = 0; e < 16; ++e)
    for (int k = 0; k < counts[e]; ++k) rows.insert(rows.end(), {(float)e, (float)k, 0.5f});
  const std::vector<float> sent = rows;
  const float* buffer = rows.data();
  const ExchangeTag dispatch{1, (int)ExchangePhase::kDispatch}, combine{1, (int)ExchangePhase::kCombine};
  ex.start_to_experts(dispatch, std::move(rows), counts, width);
  std::vector<float> at_experts;
  std::vector<int> out_counts;
  ex.finish_to_experts(dispatch, &at_experts, &out_counts);
  ASSERT_TRUE(ex.status().is_ok()) << ex.status().to_string();
  EXPECT_EQ(at_experts, sent);
  EXPECT_EQ(out_counts, counts);
  EXPECT_EQ(at_experts.data(), buffer);
  ex.start_to_sources(combine, std::move(at_experts), width);
  std::vector<float> back;
  ex.finish_to_sources(combine, &back);
  ASSERT_TRUE(ex.status().is_ok()) << ex.status().to_string();
  EXPECT_EQ(back, sent);
  EXPECT_EQ(back.data(), buffer);
}

TEST(HybridExchange, ASilentPeerFailsTheExchangeWithAStatusNotAHang) {
  Cluster cluster(2);
  HybridExpertExchange ex(cluster.transports[0].get(), Topology({2}, {1}), 4, std::chrono::milliseconds(300));
  std::vector<float> rows(4 * 3, 1.0f), out;
  std::vector<int> counts = {1, 1, 1, 1}, out_counts;
  ex.to_experts({0, (int)ExchangePhase::kDispatch}, rows.data(), counts, 3, &out, &out_counts);
  EXPECT_EQ(ex.status().code(), Status::Code::kTimeout);
  // Shapes stay consistent, so the model code can finish the step.
  EXPECT_EQ(out_counts.size(), ex.computed_experts().size());
  std::vector<float> back;
  ex.to_sources({0, (int)ExchangePhase::kCombine}, out.data(), out.size() / 3, 3, &back);
  EXPECT_EQ(back.size(), rows.size());
  // The next layer, and a second chunk, after the failure: no message moves,
  // but each Combine still returns as many rows as its Dispatch took.
  for (int chunk : {0, 1}) {
    std::vector<float> more(6 * 3, 2.0f);
    std::vector<int> more_counts = {3, 0, 2, 1};
    ex.to_experts({1, (int)ExchangePhase::kDispatch, chunk}, more.data(), more_counts, 3, &out, &out_counts);
    EXPECT_EQ(out_counts.size(), ex.computed_experts().size());
    ex.to_sources({1, (int)ExchangePhase::kCombine, chunk}, out.data(), out.size() / 3, 3, &back);
    EXPECT_EQ(back.size(), more.size()) << "chunk " << chunk;
  }
  EXPECT_EQ(ex.status().code(), Status::Code::kTimeout) << "the first failure is the one reported";
}

}  // namespace
}  // namespace xd
