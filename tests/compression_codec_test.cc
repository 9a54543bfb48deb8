// The tensor codecs (compression/codec.h): every codec and pipeline round-trips
// within its documented error, top-k keeps exactly the k largest magnitudes,
// non-finite inputs are kept or refused as documented, and corrupt, truncated
// or hostile frames give errors, never crashes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "compression/codec.h"
#include "compression/expert_codec.h"
#include "compression/detail/number_formats.h"
#include "compression/detail/top_k.h"

namespace xd {
namespace {

std::vector<float> random_tensor(size_t n, uint32_t seed, bool ties = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = ties ? std::round(dist(rng) * 4) / 4 : dist(rng);
  return v;
}

CodecPipeline pipeline(const std::string& spec) {
  auto p = CodecPipeline::parse(spec);
  EXPECT_TRUE(p) << spec << ": " << p.status().to_string();
  return *p;
}

std::vector<float> round_trip(const CodecPipeline& p, const std::vector<float>& x, TensorShape shape) {
  EncodedTensor e;
  Status st = p.encode(x.data(), shape, &e);
  EXPECT_TRUE(st.is_ok()) << p.spec() << ": " << st.to_string();
  std::vector<float> y(x.size(), -12345.0f);
  st = decode_tensor(e.metadata, e.payload.data(), e.payload.size(), y.data(), y.size());
  EXPECT_TRUE(st.is_ok()) << p.spec() << ": " << st.to_string();
  return y;
}

const char* const kSpecs[] = {"raw", "raw+zstd:1", "zstd", "bf16", "bf16+zstd:3", "fp16", "fp16+zstd",
                              "int8_row", "int8_row+zstd:9", "int8_row:16", "int4_row", "int4_row+zstd:1",
                              "int4_row:5+zstd:1", "int4_row:1", "topk:0.1", "topk:0.01+zstd:3", "topk:1",
                              "topk_sign:0.1", "topk_sign:0.02+zstd:1", "topk_sign:1", "block_sign:0.5",
                              "block_sign:0.25:4+zstd:1", "block_sign:1:1"};

TEST(Codec, EveryPipelineRoundTripsEmptyOneElementOddAndMatrixShapes) {
  const std::vector<TensorShape> shapes = {{1, 0}, {0, 5}, {1, 1}, {1, 7}, {1, 1001}, {3, 17}, {64, 128}};
  for (const char* spec : kSpecs) {
    const CodecPipeline p = pipeline(spec);
    EXPECT_EQ(pipeline(p.spec()).spec(), p.spec()) << "spec() parses back";
    for (const TensorShape& shape : shapes) {
      const std::vector<float> x = random_tensor(shape.elements(), 11 + shape.cols);
      const std::vector<float> y = round_trip(p, x, shape);
      ASSERT_EQ(y.size(), x.size());
      const std::string where = std::string(spec) + " " + std::to_string(shape.rows) + "x" + std::to_string(shape.cols);
      for (size_t i = 0; i < x.size(); ++i) {
        const CodecKind kind = p.stages().front().kind;
        if (kind == CodecKind::kRaw) {
          ASSERT_EQ(std::memcmp(&x[i], &y[i], 4), 0) << where;
        }
        if (kind == CodecKind::kBf16) {
          ASSERT_EQ(y[i], detail::bf16_to_float(detail::float_to_bf16(x[i]))) << where;
        }
        if (kind == CodecKind::kFp16) {
          ASSERT_EQ(y[i], static_cast<float>(static_cast<_Float16>(x[i]))) << where;
        }
        if (kind == CodecKind::kInt8Row || kind == CodecKind::kInt4Row) {
          // Half a step of the entry's scale block (the row without one).
          const size_t block = p.stages().front().scale_block ? p.stages().front().scale_block : shape.cols;
          const size_t row = i / shape.cols, first = (i % shape.cols) / block * block;
          float amax = 0;
          for (size_t c = first; c < std::min<size_t>(shape.cols, first + block); ++c)
            amax = std::max(amax, std::abs(x[row * shape.cols + c]));
          const float levels = kind == CodecKind::kInt8Row ? 127 : 7;
          ASSERT_LE(std::abs(x[i] - y[i]), amax / levels * 0.5f * 1.0001f + 1e-7f) << where << " element " << i;
        }
      }
    }
  }
}

TEST(Codec, BfloatAndHalfPrecisionStayWithinTheirRelativeError) {
  std::vector<float> x = random_tensor(4096, 5);
  for (size_t i = 0; i < 512; ++i) x[i] *= 1e-6f;  // fp16 subnormals
  const std::vector<float> b = round_trip(pipeline("bf16"), x, {1, 4096});
  const std::vector<float> h = round_trip(pipeline("fp16"), x, {1, 4096});
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_LE(std::abs(b[i] - x[i]), std::abs(x[i]) * std::ldexp(1.0f, -8));   // 8 significand bits
    EXPECT_LE(std::abs(h[i] - x[i]), std::abs(x[i]) * std::ldexp(1.0f, -11) + 3e-8f);  // 11, plus subnormals
    EXPECT_EQ(h[i], static_cast<float>(static_cast<_Float16>(x[i]))) << "the fast path rounds as the compiler does";
  }
}

// The reference: indices of the k largest |x|, ties to the lower index.
std::vector<uint32_t> naive_top_k(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return std::abs(x[a]) > std::abs(x[b]); });
  idx.resize(std::min(k, idx.size()));
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(TopK, TheSelectorKeepsExactlyTheKLargestMagnitudesWithTiesToLowerIndices) {
  detail::TopKSelector selector;
  std::vector<uint32_t> got;
  for (bool ties : {false, true})
    for (size_t n : {1u, 2u, 7u, 100u, 4099u, 20000u, 100003u})
      for (size_t k : {size_t(0), size_t(1), size_t(7), n / 1000, n / 100, n / 9, n / 3, n - 1, n}) {
        if (k > n) continue;
        std::vector<float> x = random_tensor(n, static_cast<uint32_t>(n * 31 + k), ties);
        if (n > 3) x[2] = -x[1];  // equal magnitudes of opposite sign
        if (n > 20000) std::fill(x.begin() + 500, x.begin() + 900, 3.5f);  // a tie block the sample may miss
        selector.select(x.data(), n, k, &got);
        ASSERT_EQ(got, naive_top_k(x, k)) << "n " << n << " k " << k << (ties ? " with ties" : "");
      }
  // Mostly zeros: the sample's bound is 0, so every index is a candidate.
  std::vector<float> sparse(50001, 0.0f);
  for (size_t i = 0; i < sparse.size(); i += 97) sparse[i] = static_cast<float>(i % 13) - 6.0f;
  for (size_t k : {size_t(10), size_t(400), size_t(5000)}) {
    selector.select(sparse.data(), sparse.size(), k, &got);
    ASSERT_EQ(got, naive_top_k(sparse, k)) << "mostly zeros, k " << k;
  }
}

TEST(TopK, TheErrorIsExactlyWhatWasDroppedPlusTheRoundingOfWhatWasKept) {
  const std::vector<float> x = random_tensor(10000, 9);
  for (double density : {0.001, 0.01, 0.1, 0.5}) {
    const std::vector<float> y = round_trip(pipeline("topk:" + std::to_string(density) + "+zstd"), x, {1, 10000});
    const size_t k = static_cast<size_t>(std::ceil(density * 10000 - 1e-9));
    const std::vector<uint32_t> keep = naive_top_k(x, k);
    std::vector<bool> kept(x.size(), false);
    for (uint32_t i : keep) kept[i] = true;
    double dropped = 0, rounding = 0, error = 0;
    size_t nonzero = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      error += double(x[i] - y[i]) * (x[i] - y[i]);
      if (kept[i]) {
        const double r = x[i] - detail::bf16_to_float(detail::float_to_bf16(x[i]));
        rounding += r * r;
        ASSERT_EQ(y[i], detail::bf16_to_float(detail::float_to_bf16(x[i]))) << "kept entry " << i;
      } else {
        dropped += double(x[i]) * x[i];
        ASSERT_EQ(y[i], 0.0f) << "dropped entry " << i;
      }
      nonzero += y[i] != 0;
    }
    EXPECT_EQ(nonzero, k) << "density " << density;
    EXPECT_NEAR(error, dropped + rounding, 1e-9 * (dropped + rounding)) << "density " << density;
  }
}

// The reference for int8_row and int4_row (block = the row) and for
// int8_row:B and int4_row:B: each block of B entries of a row on its own
// scale, its largest magnitude over the levels.
std::vector<float> naive_scale_blocks(const std::vector<float>& x, TensorShape shape, size_t block, float levels) {
  std::vector<float> y(x.size());
  for (size_t r = 0; r < shape.rows; ++r)
    for (size_t first = 0; first < shape.cols; first += block) {
      const size_t end = std::min<size_t>(shape.cols, first + block);
      float amax = 0;
      for (size_t c = first; c < end; ++c) amax = std::max(amax, std::abs(x[r * shape.cols + c]));
      const float scale = amax / levels, inv = scale > 0 ? 1.0f / scale : 0.0f;
      for (size_t c = first; c < end; ++c) {
        const size_t i = r * shape.cols + c;
        y[i] = std::nearbyint(std::clamp(x[i] * inv, -levels, levels)) * scale;
      }
    }
  return y;
}

TEST(Int8Row, EachEntryIsItsValueOverTheRowsScaleRoundedToNearestTiesToEven) {
  // Row 0 has scale 1 (its largest magnitude is 127) and a tie in every
  // entry after the first: -125.5 .. 126.5 round to the even neighbour, as
  // nearbyint does. The other rows are random, one of them all zeros.
  const TensorShape shape{4, 254};
  std::vector<float> x = random_tensor(shape.elements(), 21);
  x[0] = 127.0f;
  for (size_t c = 1; c < shape.cols; ++c) x[c] = float(int(c) - 127) + 0.5f;
  std::fill(x.begin() + 2 * 254, x.begin() + 3 * 254, 0.0f);
  const std::vector<float> y = round_trip(pipeline("int8_row"), x, shape);
  const std::vector<float> want = naive_scale_blocks(x, shape, shape.cols, 127.0f);
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(want[i], y[i]) << "row " << i / shape.cols << " col " << i % shape.cols << ": " << x[i];
  EXPECT_EQ(y[1], -126.0f) << "-125.5 rounds to the even -126";
  EXPECT_EQ(y[4], -122.0f) << "-122.5 rounds to the even -122";
  EXPECT_EQ(y[5], -122.0f) << "-121.5 rounds to the even -122";
  // A row whose largest magnitude is subnormal: the inverse of its scale
  // overflows, and its zeros still come back as 0, not NaN.
  const std::vector<float> t = round_trip(pipeline("int8_row"), {0.0f, 1e-39f, -5e-40f, -0.0f}, {1, 4});
  EXPECT_EQ(t[0], 0.0f);
  EXPECT_GT(t[1], 0.0f);
  EXPECT_LT(t[2], 0.0f);
  EXPECT_EQ(t[3], 0.0f);
}

TEST(Int4Row, EachEntryIsItsValueOverTheRowsScaleRoundedToNearestTiesToEvenTwoToAByte) {
  // Row 0 has scale 1 (its largest magnitude is 7) and ties: -6.5 .. 6.5
  // round to the even neighbour. Rows of odd length leave a padding nibble.
  for (const TensorShape shape : {TensorShape{3, 15}, TensorShape{3, 16}}) {
    std::vector<float> x = random_tensor(shape.elements(), 5 + shape.cols);
    x[0] = 7.0f;
    for (size_t c = 1; c < shape.cols; ++c) x[c] = float(int(c % 14) - 7) + 0.5f;
    std::fill(x.begin() + 2 * shape.cols, x.end(), 0.0f);
    EncodedTensor e;
    ASSERT_TRUE(pipeline("int4_row").encode(x.data(), shape, &e).is_ok());
    EXPECT_EQ(e.payload.size(), 4 * shape.rows + shape.rows * ((shape.cols + 1) / 2)) << "two entries a byte";
    const std::vector<float> y = round_trip(pipeline("int4_row"), x, shape);
    const std::vector<float> want = naive_scale_blocks(x, shape, shape.cols, 7.0f);
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(want[i], y[i]) << "row " << i / shape.cols << " col " << i % shape.cols;
    EXPECT_EQ(y[1], -6.0f) << "-5.5 rounds to the even -6";
    EXPECT_EQ(y[2], -4.0f) << "-4.5 rounds to the even -4";
  }
}

// Long rows take the encoders' 16-at-a-time paths (compression/detail/
// int_rows.cc) wherever a block allows; they must give the reference's
// values in every block, whether it starts mid-byte, ends in a short tail,
// holds ties, or has a subnormal largest magnitude (an infinite inverse)
// beside zeros of either sign.
TEST(IntRows, LongRowsGiveTheReferenceValuesWhateverTheBlocksAndWhereTheyStart) {
  for (const size_t cols : {31, 1000, 4097}) {
    const TensorShape shape{3, cols};
    for (const bool ties : {false, true}) {
      std::vector<float> x = random_tensor(shape.elements(), static_cast<uint32_t>(cols + ties), ties);
      for (size_t c = 0; c < std::min<size_t>(cols, 40); ++c)  // row 2 begins subnormal
        x[2 * cols + c] = c % 3 == 0 ? 0.0f : c % 3 == 1 ? -0.0f : (c % 2 ? 1e-39f : -7e-40f);
      for (const size_t block : {0, 7, 16, 33, 128}) {
        for (const auto& [name, levels] : {std::pair<const char*, float>{"int4_row", 7.0f}, {"int8_row", 127.0f}}) {
          const std::string spec = block == 0 ? name : std::string(name) + ":" + std::to_string(block);
          const std::vector<float> y = round_trip(pipeline(spec), x, shape);
          const std::vector<float> want = naive_scale_blocks(x, shape, block == 0 ? cols : block, levels);
          // The reference's 0 * inf is NaN; a zero stays 0 (int_rows.h).
          for (size_t i = 0; i < x.size(); ++i)
            ASSERT_EQ(std::isnan(want[i]) && x[i] == 0 ? 0.0f : want[i], y[i])
                << spec << ", " << cols << " columns, ties " << ties << ", element " << i;
        }
      }
    }
  }
}

TEST(Int4Row, AZeroNibbleSetPaddingOrABadScaleIsCorruption) {
  const TensorShape shape{2, 5};
  const std::vector<float> x = random_tensor(shape.elements(), 9);
  EncodedTensor e;
  ASSERT_TRUE(pipeline("int4_row").encode(x.data(), shape, &e).is_ok());
  std::vector<float> y(x.size());
  ASSERT_TRUE(decode_tensor(e.metadata, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok());
  auto refused = [&](std::vector<uint8_t> p, const std::string& why) {
    const Status st = decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
    EXPECT_FALSE(st.is_ok()) << why;
    EXPECT_NE(st.message().find(why), std::string::npos) << st.message();
  };
  std::vector<uint8_t> p = e.payload;
  p[8] &= 0xf0;  // row 0, entry 0: nibble 0
  refused(p, "nibble of 0");
  p = e.payload;
  p[8 + 2] |= 0x10;  // row 0's padding nibble (entry 5 of 5)
  refused(p, "padding");
  p = e.payload;
  const float nan = std::numeric_limits<float>::quiet_NaN(), negative = -1.0f;
  std::memcpy(p.data() + 4, &nan, 4);
  refused(p, "bad scale in row 1");
  std::memcpy(p.data() + 4, &negative, 4);
  refused(p, "bad scale in row 1");
  // In a long row, where the decoder takes 16 entries at a time, a zero
  // nibble at either place of a byte is refused too.
  const TensorShape wide{2, 1000};
  const std::vector<float> w = random_tensor(wide.elements(), 19);
  EncodedTensor we;
  ASSERT_TRUE(pipeline("int4_row:128").encode(w.data(), wide, &we).is_ok());
  const size_t values = 4 * 2 * 8;  // 8 scales a row
  std::vector<float> wy(w.size());
  for (const auto& [at, keep] : {std::pair<size_t, uint8_t>{values + 500 + 250, 0xf0}, {values + 500 + 37, 0x0f}}) {
    std::vector<uint8_t> q = we.payload;
    q[at] &= keep;
    const Status st = decode_tensor(we.metadata, q.data(), q.size(), wy.data(), wy.size());
    EXPECT_FALSE(st.is_ok()) << "byte " << at;
    EXPECT_NE(st.message().find("nibble of 0 in row 1"), std::string::npos) << st.message();
  }
}

TEST(IntRows, EachScaleBlockHasItsOwnScaleSoOneLargeEntryCoarsensOnlyItsBlock) {
  // Blocks of 7 over rows of 21 (blocks that start mid-byte in int4) and of
  // 8 (a short last block); row 1 holds one entry 1000x the rest.
  const TensorShape shape{3, 21};
  std::vector<float> x = random_tensor(shape.elements(), 31);
  x[21 + 3] = 1000.0f;
  std::fill(x.begin() + 42 + 8, x.begin() + 42 + 16, 0.0f);  // with blocks of 8, an all-zero block
  const std::tuple<const char*, float, size_t, size_t> cases[] = {
      {"int8_row", 127.0f, 21, 7}, {"int8_row", 127.0f, 21, 8}, {"int4_row", 7.0f, 11, 7}, {"int4_row", 7.0f, 11, 8}};
  for (const auto& [name, levels, value_bytes, block] : cases) {
    const std::string spec = std::string(name) + ":" + std::to_string(block);
    EncodedTensor e;
    ASSERT_TRUE(pipeline(spec).encode(x.data(), shape, &e).is_ok());
    EXPECT_EQ(e.payload.size(), shape.rows * (3 * 4 + value_bytes)) << spec << ": 3 scales a row";
    const std::vector<float> y = round_trip(pipeline(spec), x, shape);
    const std::vector<float> want = naive_scale_blocks(x, shape, block, levels);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(want[i], y[i]) << spec << " element " << i;
    // Row 1's other blocks keep their precision; with one scale for the row
    // the large entry's step swallows them.
    const std::vector<float> whole = round_trip(pipeline(name), x, shape);
    double block_err = 0, row_err = 0;
    for (size_t c = block; c < 21; ++c) {
      block_err += std::pow(x[21 + c] - y[21 + c], 2);
      row_err += std::pow(x[21 + c] - whole[21 + c], 2);
    }
    EXPECT_LT(block_err * 10, row_err) << spec;
  }
  // A scale block as long as the row writes the bytes of the whole row's scale.
  for (const char* name : {"int8_row", "int4_row"}) {
    EncodedTensor whole, long_block;
    ASSERT_TRUE(pipeline(name).encode(x.data(), shape, &whole).is_ok());
    ASSERT_TRUE(pipeline(std::string(name) + ":21").encode(x.data(), shape, &long_block).is_ok());
    EXPECT_EQ(whole.payload, long_block.payload) << name;
  }
}

TEST(IntRows, ABadScaleInAnyBlockOrABlockOnAnotherCodecIsCorruption) {
  const TensorShape shape{2, 10};
  const std::vector<float> x = random_tensor(shape.elements(), 37);
  for (const char* spec : {"int8_row:4", "int4_row:4"}) {
    EncodedTensor e;
    ASSERT_TRUE(pipeline(spec).encode(x.data(), shape, &e).is_ok());
    std::vector<float> y(x.size());
    std::vector<uint8_t> p = e.payload;
    const float negative = -1.0f;
    std::memcpy(p.data() + 4 * 4, &negative, 4);  // row 1's second block (3 scales a row)
    const Status st = decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
    EXPECT_FALSE(st.is_ok()) << spec;
    EXPECT_NE(st.message().find("bad scale in row 1"), std::string::npos) << st.message();
    // The record's block must match the payload: another block size is
    // another payload size.
    auto rec = parse_codec_record(e.metadata);
    ASSERT_TRUE(rec);
    rec->stages.front().block = 5;
    EXPECT_FALSE(decode_tensor(*rec, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok()) << spec;
  }
  // A block on a codec without one is refused when the record is read.
  EncodedTensor e;
  ASSERT_TRUE(pipeline("int8_row:4").encode(x.data(), shape, &e).is_ok());
  std::string m = e.metadata;
  const size_t kind_at = m.find("kind");
  ASSERT_NE(kind_at, std::string::npos);
  m[kind_at + 4] = static_cast<char>(CodecKind::kBf16);  // a positive fixint after the key
  const auto rec = parse_codec_record(m);
  ASSERT_FALSE(rec);
  EXPECT_NE(rec.status().message().find("bf16 stage with a 'block'"), std::string::npos) << rec.status().message();
}

TEST(TopKSign, KeepsTheLargestMagnitudesAsTheirSignTimesTheMeanMagnitudeOfTheirRow) {
  const TensorShape shape{5, 401};
  std::vector<float> x = random_tensor(shape.elements(), 13);
  std::fill(x.begin() + 3 * 401, x.begin() + 4 * 401, 0.0f);  // a row of zeros keeps nothing
  for (size_t i = 0; i < 401; i += 3) x[i] = 0.0f;                // zeros inside a kept row
  for (double density : {0.01, 0.1, 0.5, 1.0}) {
    const std::vector<float> y = round_trip(pipeline("topk_sign:" + std::to_string(density) + "+zstd:1"), x, shape);
    const size_t k = static_cast<size_t>(std::ceil(density * shape.elements() - 1e-9));
    std::vector<uint32_t> keep = naive_top_k(x, k);
    keep.erase(std::remove_if(keep.begin(), keep.end(), [&](uint32_t i) { return x[i] == 0.0f; }), keep.end());
    std::vector<double> sum(shape.rows, 0.0);
    std::vector<size_t> count(shape.rows, 0);
    for (uint32_t i : keep) {
      sum[i / shape.cols] += std::abs(x[i]);
      ++count[i / shape.cols];
    }
    std::vector<float> want(x.size(), 0.0f);
    for (uint32_t i : keep) {
      const float scale = static_cast<float>(sum[i / shape.cols] / static_cast<double>(count[i / shape.cols]));
      want[i] = x[i] < 0 ? -scale : scale;
    }
    ASSERT_EQ(0, std::memcmp(want.data(), y.data(), 4 * x.size())) << "density " << density;
    EXPECT_EQ(count[3], 0u) << "the zero row";
  }
}

// topk_sign:1 of a tensor without zeros takes a fast path
// (compression/detail/every_sign.h). The reference is the format itself,
// written out naively: index 0 then gaps of 1 as varints, each row's mean
// |x| summed in column order in double, then the sign bits low bit first.
TEST(TopKSign, KeepingEveryEntryOfATensorWithoutZerosWritesAndReadsTheGeneralFormat) {
  for (const TensorShape shape : {TensorShape{1, 1}, TensorShape{3, 5}, TensorShape{5, 401}, TensorShape{7, 8},
                                  TensorShape{6, 13}, TensorShape{2, 300}}) {
    std::vector<float> x = random_tensor(shape.elements(), 17 + static_cast<uint32_t>(shape.cols));
    x[0] = -std::numeric_limits<float>::denorm_min();  // a subnormal keeps its sign
    std::vector<uint8_t> want;
    for (size_t i = 0; i < x.size(); ++i) want.push_back(i == 0 ? 0 : 1);
    std::vector<float> decoded(x.size());
    for (size_t r = 0; r < shape.rows; ++r) {
      double sum = 0;
      for (size_t c = 0; c < shape.cols; ++c) sum += std::abs(x[r * shape.cols + c]);
      const float scale = static_cast<float>(sum / static_cast<double>(shape.cols));
      uint8_t bytes[4];
      std::memcpy(bytes, &scale, 4);
      want.insert(want.end(), bytes, bytes + 4);
      for (size_t c = 0; c < shape.cols; ++c) decoded[r * shape.cols + c] = x[r * shape.cols + c] < 0 ? -scale : scale;
    }
    std::vector<uint8_t> signs((x.size() + 7) / 8, 0);
    for (size_t i = 0; i < x.size(); ++i) signs[i / 8] |= static_cast<uint8_t>(std::signbit(x[i])) << (i % 8);
    want.insert(want.end(), signs.begin(), signs.end());

    EncodedTensor e;
    SparseTensor kept;
    ASSERT_TRUE(pipeline("topk_sign:1").encode(x.data(), shape, &e, &kept).is_ok());
    EXPECT_EQ(e.payload, want) << shape.rows << "x" << shape.cols;
    std::vector<float> y(x.size(), 7.0f);
    ASSERT_TRUE(decode_tensor(e.metadata, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok());
    EXPECT_EQ(0, std::memcmp(y.data(), decoded.data(), 4 * y.size())) << shape.rows << "x" << shape.cols;
    std::vector<uint32_t> every(x.size());
    std::iota(every.begin(), every.end(), 0u);
    EXPECT_EQ(kept.index, every);
    ASSERT_EQ(kept.value.size(), x.size());
    EXPECT_EQ(0, std::memcmp(kept.value.data(), decoded.data(), 4 * x.size()));
    auto rec = parse_codec_record(e.metadata);
    ASSERT_TRUE(rec);
    SparseTensor read;
    ASSERT_TRUE(decode_sparse(*rec, e.payload.data(), e.payload.size(), &read).is_ok());
    EXPECT_EQ(read.index, every);
    ASSERT_EQ(read.value.size(), x.size());
    EXPECT_EQ(0, std::memcmp(read.value.data(), decoded.data(), 4 * x.size()));

    // The general path still reads what is not quite this form: a gap of 2
    // instead of the last 1 drops an entry from the list and shifts it.
    if (x.size() >= 3) {
      std::vector<uint8_t> gap = e.payload;
      gap[x.size() - 1] = 2;
      EXPECT_FALSE(decode_tensor(e.metadata, gap.data(), gap.size(), y.data(), y.size()).is_ok())
          << "an index beyond the tensor";
    }
    // A bad scale is refused as the general path refuses it.
    std::vector<uint8_t> nan_scale = e.payload;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(nan_scale.data() + x.size(), &nan, 4);
    const Status st = decode_tensor(e.metadata, nan_scale.data(), nan_scale.size(), y.data(), y.size());
    EXPECT_EQ(st.code(), Status::Code::kCorruption) << st.to_string();
    EXPECT_FALSE(decode_sparse(*rec, nan_scale.data(), nan_scale.size(), &read).is_ok());
  }
}

// The reference: each row's blocks by energy (ties to the lower block), the
// kept ones as sign x the mean |x| of the row's kept entries.
std::vector<float> naive_block_sign(const std::vector<float>& x, TensorShape shape, size_t block, double density) {
  std::vector<float> want(x.size(), 0.0f);
  const size_t blocks = (shape.cols + block - 1) / block;
  for (size_t r = 0; r < shape.rows; ++r) {
    std::vector<std::pair<double, size_t>> energy;
    for (size_t b = 0; b < blocks; ++b) {
      double e = 0;
      for (size_t c = b * block; c < std::min<size_t>(shape.cols, (b + 1) * block); ++c)
        e += double(x[r * shape.cols + c]) * x[r * shape.cols + c];
      energy.push_back({-e, b});
    }
    std::sort(energy.begin(), energy.end());
    const size_t keep = std::max<size_t>(1, static_cast<size_t>(std::ceil(density * blocks - 1e-9)));
    std::vector<size_t> chosen;
    for (size_t j = 0; j < std::min(keep, blocks); ++j) chosen.push_back(energy[j].second);
    std::sort(chosen.begin(), chosen.end());  // the scale sums the kept blocks in block order
    std::vector<size_t> kept;
    double magnitude = 0;
    for (size_t b : chosen)
      for (size_t c = b * block; c < std::min<size_t>(shape.cols, (b + 1) * block); ++c) {
        kept.push_back(r * shape.cols + c);
        magnitude += std::abs(x[r * shape.cols + c]);
      }
    const float scale = kept.empty() ? 0.0f : static_cast<float>(magnitude / static_cast<double>(kept.size()));
    for (size_t i : kept) want[i] = std::signbit(x[i]) ? -scale : scale;
  }
  return want;
}

TEST(BlockSign, KeepsEachRowsBlocksOfLargestEnergyAsSignsTimesTheRowsMeanMagnitude) {
  const TensorShape shape{5, 401};  // 401 = 25 x 16 + 1: every row ends in a block of one
  std::vector<float> x = random_tensor(shape.elements(), 17);
  std::fill(x.begin() + 2 * 401, x.begin() + 3 * 401, 0.0f);  // a row of zeros: equal energies, the first blocks
  for (size_t i = 0; i < 401; i += 5) x[i] = 0.0f;               // zeros inside kept blocks decode to +scale
  for (size_t block : {1, 7, 16, 401, 1000})
    for (double density : {0.01, 0.3, 0.5, 1.0}) {
      const std::string spec = "block_sign:" + std::to_string(density) + ":" + std::to_string(block) + "+zstd:1";
      const std::vector<float> y = round_trip(pipeline(spec), x, shape);
      const std::vector<float> want = naive_block_sign(x, shape, block, density);
      ASSERT_EQ(0, std::memcmp(want.data(), y.data(), 4 * x.size())) << spec;
    }
}

TEST(BlockSign, BlocksOfEqualEnergyAreKeptLowestFirst) {
  // One row of six equal blocks of 4 and one row where blocks 1 and 4 tie
  // above the rest.
  std::vector<float> x(2 * 24);
  for (size_t c = 0; c < 24; ++c) x[c] = (c % 4 == 1 ? -1.5f : 0.5f);
  for (size_t c = 0; c < 24; ++c) x[24 + c] = (c / 4 == 1 || c / 4 == 4) ? 2.0f : 0.25f;
  EncodedTensor e;
  ASSERT_TRUE(pipeline("block_sign:0.34:4").encode(x.data(), {2, 24}, &e).is_ok());  // 3 blocks a row
  auto rec = parse_codec_record(e.metadata);
  ASSERT_TRUE(rec);
  SparseTensor kept;
  ASSERT_TRUE(decode_sparse(*rec, e.payload.data(), e.payload.size(), &kept).is_ok());
  std::vector<uint32_t> want;
  for (uint32_t i = 0; i < 12; ++i) want.push_back(i);  // row 0: blocks 0, 1, 2
  // Row 1: blocks 1 and 4, then the lowest of the four equal ones, block 0.
  for (uint32_t i = 24; i < 32; ++i) want.push_back(i);
  for (uint32_t i = 40; i < 44; ++i) want.push_back(i);
  EXPECT_EQ(kept.index, want);
}

TEST(BlockSign, HostileBlockFieldsAreRefused) {
  const std::vector<float> x = random_tensor(64, 31);
  EncodedTensor e;
  ASSERT_TRUE(pipeline("block_sign:0.5:16").encode(x.data(), {1, 64}, &e).is_ok());
  std::vector<float> y(64);
  const size_t at = e.metadata.find("block");
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(static_cast<uint8_t>(e.metadata[at + 5]), 0x10) << "block 16, a msgpack positive fixint";
  auto decode_with_block = [&](const std::string& value) {
    std::string m = e.metadata;
    m.replace(at + 5, 1, value);
    return decode_tensor(m, e.payload.data(), e.payload.size(), y.data(), y.size());
  };
  EXPECT_NE(decode_with_block(std::string(1, '\0')).message().find("block of 0 entries"), std::string::npos);
  EXPECT_NE(decode_with_block(std::string("\xce\x00\x01\x00\x01", 5)).message().find("block of 65537 entries"),
            std::string::npos);
  // Another block size than the payload was made for: 16 blocks of 4 need
  // another bitmap size.
  EXPECT_NE(decode_with_block(std::string(1, '\x04')).message().find("do not fit"), std::string::npos);
  // A record that says one entry more than the blocks hold.
  auto rec = parse_codec_record(e.metadata);
  ASSERT_TRUE(rec);
  rec->stages.front().kept += 1;
  EXPECT_FALSE(decode_tensor(*rec, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok());
  // A record built by hand with no block size is refused, not divided by.
  rec = parse_codec_record(e.metadata);
  rec->stages.front().block = 0;
  EXPECT_FALSE(decode_tensor(*rec, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok());
}

TEST(BlockSign, HalfTheBlocksCostAboutHalfABitAWeightAndLessThanTopKSignOfAsManyEntries) {
  const std::vector<float> x = random_tensor(64 * 1024, 23);
  EncodedTensor block, sign;
  ASSERT_TRUE(pipeline("block_sign:0.5").encode(x.data(), {4, 16 * 1024}, &block).is_ok());
  ASSERT_TRUE(pipeline("topk_sign:0.5").encode(x.data(), {4, 16 * 1024}, &sign).is_ok());
  // 4 scales, a bit per block of 16, a bit per kept entry: 9/16 bit a weight.
  EXPECT_EQ(block.payload.size(), 4 * 4 + 64 * 1024 / 16 / 8 + 64 * 1024 / 2 / 8);
  EXPECT_LT(block.payload.size() * 3, sign.payload.size() * 2) << block.payload.size() << " vs " << sign.payload.size();
}

TEST(BlockSign, ABitmapThatDisagreesWithTheRecordOrBitsPastTheEndAreErrors) {
  const std::vector<float> x = random_tensor(3 * 100, 29);
  EncodedTensor e;
  // Every block kept: 300 entries, so the last sign byte has 4 unused bits.
  ASSERT_TRUE(pipeline("block_sign:1:16").encode(x.data(), {3, 100}, &e).is_ok());
  std::vector<float> y(x.size());
  ASSERT_TRUE(decode_tensor(e.metadata, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok());
  const size_t bitmap = 3 * 4, blocks = 3 * 7;  // 7 blocks a row, the last of 4 entries
  std::vector<uint8_t> p = e.payload;
  p[bitmap] ^= 1;  // one block fewer than the record's entries
  Status st = decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
  EXPECT_NE(st.message().find("kept blocks hold"), std::string::npos) << st.to_string();
  p = e.payload;
  p[bitmap + blocks / 8] |= static_cast<uint8_t>(0x80);  // past the last block
  st = decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
  EXPECT_NE(st.message().find("beyond the last block"), std::string::npos) << st.to_string();
  p = e.payload;
  p.back() |= 0x80;  // past the last sign
  st = decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
  EXPECT_NE(st.message().find("sign bits set beyond"), std::string::npos) << st.to_string();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  p = e.payload;
  std::memcpy(p.data() + 4, &nan, 4);
  st = decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
  EXPECT_NE(st.message().find("bad scale in row 1"), std::string::npos) << st.to_string();
}

TEST(TopKSign, OneBitValuesCostLessThanHalfTheBf16TopKForTheSameEntries) {
  const std::vector<float> x = random_tensor(64 * 1024, 21);
  EncodedTensor sign, bf16;
  ASSERT_TRUE(pipeline("topk_sign:0.05").encode(x.data(), {4, 16 * 1024}, &sign).is_ok());
  ASSERT_TRUE(pipeline("topk:0.05").encode(x.data(), {4, 16 * 1024}, &bf16).is_ok());
  // Gaps of about 20 fit one varint byte: ~1.125 bytes an entry against ~3.
  EXPECT_LT(sign.payload.size() * 2, bf16.payload.size()) << sign.payload.size() << " vs " << bf16.payload.size();
}

TEST(Codec, NonFiniteValuesAreKeptByTheCastsAndRefusedByInt8AndTopK) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {1.5f, nan, -inf, inf, -2.0f, 1e30f};
  for (const char* spec : {"raw", "raw+zstd", "bf16", "fp16+zstd"}) {
    const std::vector<float> y = round_trip(pipeline(spec), x, {1, 6});
    EXPECT_TRUE(std::isnan(y[1])) << spec;
    EXPECT_EQ(y[2], -inf) << spec;
    EXPECT_EQ(y[3], inf) << spec;
  }
  EXPECT_EQ(round_trip(pipeline("fp16"), x, {1, 6})[5], inf) << "beyond fp16's range";
  for (const char* spec : {"int8_row", "int4_row", "topk:0.5+zstd", "topk_sign:0.5", "block_sign:0.5:2"}) {
    EncodedTensor e;
    Status st = pipeline(spec).encode(x.data(), {1, 6}, &e);
    EXPECT_FALSE(st.is_ok()) << spec;
    EXPECT_NE(st.message().find("element 1"), std::string::npos) << st.message();
  }
}

TEST(Codec, BadSpecsAreRefusedNamingThePart) {
  for (const char* spec : {"", "bf17", "topk", "topk:0", "topk:1.5", "topk:x", "topk_sign", "topk_sign:0", "zstd:0",
                           "block_sign", "block_sign:0", "block_sign:0.5:0", "block_sign:0.5:x", "block_sign:0.5:1.5",
                           "block_sign:0.5:70000", "block_sign:2", "int4_row:0", "int4_row:x", "int8_row:1.5",
                           "int8_row:70000", "int4_row:4:4",
                           "zstd:3.5", "bf16:2",
                           "bf16+fp16", "zstd+bf16", "bf16+zstd+zstd", "raw+"}) {
    auto p = CodecPipeline::parse(spec);
    EXPECT_FALSE(p) << "'" << spec << "' was accepted";
    if (!p) {
      EXPECT_NE(p.status().message().find("codec '"), std::string::npos) << p.status().message();
    }
  }
}

TEST(Codec, TruncatedOrCorruptPayloadsAndMetadataAreErrorsNeverCrashes) {
  const std::vector<float> x = random_tensor(3 * 257, 3);
  std::mt19937 rng(42);
  for (const char* spec : kSpecs) {
    EncodedTensor e;
    ASSERT_TRUE(pipeline(spec).encode(x.data(), {3, 257}, &e).is_ok());
    std::vector<float> y(x.size());
    // A payload one byte short, or one byte long.
    if (!e.payload.empty()) {
      EXPECT_FALSE(decode_tensor(e.metadata, e.payload.data(), e.payload.size() - 1, y.data(), y.size()).is_ok()) << spec;
    }
    std::vector<uint8_t> longer = e.payload;
    longer.push_back(0);
    EXPECT_FALSE(decode_tensor(e.metadata, longer.data(), longer.size(), y.data(), y.size()).is_ok()) << spec;
    // The wrong output size.
    EXPECT_FALSE(decode_tensor(e.metadata, e.payload.data(), e.payload.size(), y.data(), y.size() - 1).is_ok()) << spec;
    // Truncated metadata, at every length.
    for (size_t cut = 0; cut < e.metadata.size(); ++cut)
      EXPECT_FALSE(decode_tensor(e.metadata.substr(0, cut), e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok())
          << spec << " metadata cut at " << cut;
    // Every metadata byte flipped: an error, or (a byte that changes
    // nothing the decoder uses, such as the zstd level it was encoded at)
    // the same output to the bit.
    std::vector<float> reference(x.size());
    ASSERT_TRUE(decode_tensor(e.metadata, e.payload.data(), e.payload.size(), reference.data(), reference.size())
                    .is_ok());
    int harmless = 0, flips = 0;
    for (size_t i = 0; i < e.metadata.size(); ++i)
      for (uint8_t flip : {0x01, 0x80, 0xff}) {
        std::string m = e.metadata;
        m[i] = static_cast<char>(m[i] ^ flip);
        ++flips;
        std::fill(y.begin(), y.end(), -1.0f);
        if (!decode_tensor(m, e.payload.data(), e.payload.size(), y.data(), y.size()).is_ok()) continue;
        ++harmless;
        EXPECT_EQ(0, std::memcmp(y.data(), reference.data(), y.size() * sizeof(float)))
            << spec << ": metadata byte " << i << " ^ " << int(flip) << " decoded to other values";
      }
    EXPECT_LT(harmless, flips / 4) << spec << ": most flips must be refused";
    // Random payload bytes: decode returns (an error, or whatever values the
    // bytes now say), reading only inside its buffers (the sanitizer builds
    // and fuzz_codec check that part).
    for (int trial = 0; trial < 200 && !e.payload.empty(); ++trial) {
      std::vector<uint8_t> p = e.payload;
      p[rng() % p.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
      (void)decode_tensor(e.metadata, p.data(), p.size(), y.data(), y.size());
    }
  }
}

TEST(Codec, ASparseDecodeGivesTheKeptEntriesOfTheDenseDecodeAndOfTheEncoderAndRefusesWhatTheDenseOneRefuses) {
  const std::vector<float> x = random_tensor(3 * 257, 5);
  for (const char* spec : {"topk:0.05", "topk:0.3+zstd:1", "topk:1", "topk_sign:0.05", "topk_sign:0.3+zstd:1",
                           "topk_sign:1", "topk_sign:1+zstd:1", "block_sign:0.3", "block_sign:0.5:5+zstd:1"}) {
    EncodedTensor e;
    ASSERT_TRUE(pipeline(spec).encode(x.data(), {3, 257}, &e).is_ok());
    auto rec = parse_codec_record(e.metadata);
    ASSERT_TRUE(rec) << spec;
    ASSERT_TRUE(is_sparse(*rec)) << spec;
    std::vector<float> dense(x.size());
    ASSERT_TRUE(decode_tensor(*rec, e.payload.data(), e.payload.size(), dense.data(), dense.size()).is_ok());
    SparseTensor sparse;
    ASSERT_TRUE(decode_sparse(*rec, e.payload.data(), e.payload.size(), &sparse).is_ok()) << spec;
    ASSERT_EQ(sparse.index.size(), rec->stages.front().kept) << spec;
    ASSERT_EQ(sparse.value.size(), sparse.index.size());
    std::vector<float> rebuilt(x.size(), 0.0f);
    for (size_t j = 0; j < sparse.index.size(); ++j) {
      if (j > 0) {
        ASSERT_LT(sparse.index[j - 1], sparse.index[j]) << "indices ascend";
      }
      rebuilt[sparse.index[j]] = sparse.value[j];
    }
    EXPECT_EQ(0, std::memcmp(rebuilt.data(), dense.data(), dense.size() * sizeof(float))) << spec;
    // The encoder's own list of what it kept is the decoder's, to the bit.
    SparseTensor kept;
    EncodedTensor again;
    ASSERT_TRUE(pipeline(spec).encode(x.data(), {3, 257}, &again, &kept).is_ok());
    EXPECT_EQ(again.payload, e.payload) << spec;
    EXPECT_EQ(kept.index, sparse.index) << spec;
    ASSERT_EQ(kept.value.size(), sparse.value.size()) << spec;
    EXPECT_EQ(0, std::memcmp(kept.value.data(), sparse.value.data(), 4 * kept.value.size())) << spec;
    // The dense decoder's refusals are the sparse one's.
    EXPECT_FALSE(decode_sparse(*rec, e.payload.data(), e.payload.size() - 1, &sparse).is_ok()) << spec;
    std::mt19937 rng(7);
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<uint8_t> p = e.payload;
      p[rng() % p.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
      const bool dense_ok = decode_tensor(*rec, p.data(), p.size(), dense.data(), dense.size()).is_ok();
      EXPECT_EQ(dense_ok, decode_sparse(*rec, p.data(), p.size(), &sparse).is_ok()) << spec << " trial " << trial;
    }
  }
  EncodedTensor e;
  ASSERT_TRUE(pipeline("bf16").encode(x.data(), {3, 257}, &e).is_ok());
  auto rec = parse_codec_record(e.metadata);
  ASSERT_TRUE(rec);
  EXPECT_FALSE(is_sparse(*rec));
  SparseTensor sparse;
  EXPECT_EQ(decode_sparse(*rec, e.payload.data(), e.payload.size(), &sparse).code(), Status::Code::kInvalidArgument);
}

TEST(Codec, HostileMetadataIsRefusedWithTheReason) {
  const std::vector<float> x = random_tensor(100, 1);
  EncodedTensor e;
  ASSERT_TRUE(pipeline("topk:0.1").encode(x.data(), {1, 100}, &e).is_ok());
  std::vector<float> y(100);
  auto error = [&](const std::string& meta) {
    return decode_tensor(meta, e.payload.data(), e.payload.size(), y.data(), y.size()).message();
  };
  EXPECT_NE(error("not msgpack at all \xc1\xc1").find("codec metadata"), std::string::npos);
  EXPECT_NE(error(std::string("\x93\x01\x02\x03", 4)).find("not a map"), std::string::npos);
  // A topk payload whose index list points past the tensor.
  std::vector<uint8_t> far = e.payload;
  far[0] = 0x7f;  // first index 127 >= 100
  const std::string st = decode_tensor(e.metadata, far.data(), far.size(), y.data(), y.size()).message();
  EXPECT_NE(st.find("beyond the tensor"), std::string::npos) << st;
  // Shapes that claim more elements than allowed.
  EncodedTensor big;
  ASSERT_TRUE(pipeline("raw").encode(x.data(), {1, 100}, &big).is_ok());
  std::string meta = big.metadata;
  const size_t at = meta.find("cols");
  ASSERT_NE(at, std::string::npos);
  meta[at + 4] = static_cast<char>(0xcf);  // u64 follows
  meta.insert(at + 5, std::string("\x7f\xff\xff\xff\xff\xff\xff\xff", 8));  // cols = 2^63 - 1
  const std::string why = decode_tensor(meta, big.payload.data(), big.payload.size(), y.data(), y.size()).message();
  EXPECT_NE(why.find("too large"), std::string::npos) << why;
  EXPECT_FALSE(parse_codec_record(meta));
}

// Experts of one layer that share most of their weights, as trained experts
// do: a common part plus a small individual one.
std::vector<std::vector<float>> related_experts(int count, size_t n) {
  const std::vector<float> common = random_tensor(n, 100);
  std::vector<std::vector<float>> experts;
  for (int e = 0; e < count; ++e) {
    std::vector<float> own = random_tensor(n, 200 + e);
    for (size_t i = 0; i < n; ++i) own[i] = common[i] + 0.1f * own[i];
    experts.push_back(own);
  }
  return experts;
}

TEST(ExpertResidualCodec, TheReceiverRebuildsBasePlusResidualAndTheBaseBeatsPlainTopK) {
  const size_t n = 64 * 48;
  const auto experts = related_experts(8, n);
  std::vector<const float*> ptrs;
  for (const auto& e : experts) ptrs.push_back(e.data());
  std::vector<float> base(n), again(n);
  ExpertResidualCodec::mean_expert(ptrs, n, base.data());
  ExpertResidualCodec::mean_expert(ptrs, n, again.data());
  ASSERT_EQ(std::memcmp(base.data(), again.data(), n * sizeof(float)), 0) << "the base is bit-reproducible";
  for (size_t i : {size_t(0), n / 2, n - 1}) {
    double mean = 0;
    for (const auto& e : experts) mean += e[i];
    EXPECT_FLOAT_EQ(base[i], static_cast<float>(mean / 8));
  }

  auto sr = ExpertResidualCodec::create("topk:0.02+zstd:1");
  ASSERT_TRUE(sr);
  double sr_err = 0, plain_err = 0, norm = 0;
  for (const auto& expert : experts) {
    EncodedTensor e;
    ASSERT_TRUE(sr->encode(expert.data(), base.data(), {64, 48}, &e).is_ok());
    std::vector<float> rebuilt(n);
    ASSERT_TRUE(sr->decode(e.metadata, e.payload.data(), e.payload.size(), base.data(), rebuilt.data(), n).is_ok());
    // Exactly base + the decoded residual.
    std::vector<float> residual(n), decoded(n);
    for (size_t i = 0; i < n; ++i) residual[i] = expert[i] - base[i];
    decoded = round_trip(pipeline("topk:0.02+zstd:1"), residual, {64, 48});
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(rebuilt[i], base[i] + decoded[i]) << i;
    const std::vector<float> plain = round_trip(pipeline("topk:0.02+zstd:1"), expert, {64, 48});
    for (size_t i = 0; i < n; ++i) {
      sr_err += double(expert[i] - rebuilt[i]) * (expert[i] - rebuilt[i]);
      plain_err += double(expert[i] - plain[i]) * (expert[i] - plain[i]);
      norm += double(expert[i]) * expert[i];
    }
  }
  std::printf("[sr] NMSE at 2%% density: with the base %.3e, plain top-k %.3e\n", sr_err / norm, plain_err / norm);
  EXPECT_LT(sr_err, 0.05 * plain_err) << "the residual against the base must be far smaller";
  // A wrong base size or a corrupt payload is an error, as for any tensor.
  EXPECT_FALSE(ExpertResidualCodec::create("topk:7"));
}

}  // namespace
}  // namespace xd

namespace xd {
namespace {

TEST(ExpertCodecSpec, DeltaTakesALosslessPipelineAloneAndSaysWhyOtherwise) {
  auto delta = ExpertCodecSpec::parse("delta:zstd:1");
  ASSERT_TRUE(delta) << delta.status().to_string();
  EXPECT_TRUE(delta->bit_delta);
  EXPECT_FALSE(delta->is_raw());
  EXPECT_EQ(delta->spec(), "delta:raw+zstd:1");
  EXPECT_EQ(ExpertCodecSpec::parse(delta->spec())->spec(), delta->spec());
  EXPECT_TRUE(ExpertCodecSpec::parse("delta:raw")->bit_delta);
  auto lossy = ExpertCodecSpec::parse("delta:bf16+zstd:1");
  ASSERT_FALSE(lossy);
  EXPECT_NE(lossy.status().message().find("must be lossless"), std::string::npos) << lossy.status().message();
  for (const char* bad : {"delta:", "delta:sr:topk:0.1", "sr:delta:zstd", "ef:delta:zstd", "delta:zstd@5:raw"}) {
    auto r = ExpertCodecSpec::parse(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find("delta:PIPELINE"), std::string::npos) << r.status().message();
  }
}

TEST(ExpertCodecSpec, ReadsTheBaseAndFeedbackPrefixesAndRefusesTheRestNamingTheForm) {
  auto sr = ExpertCodecSpec::parse("sr:ef:topk:0.02+zstd:1");
  ASSERT_TRUE(sr) << sr.status().to_string();
  EXPECT_TRUE(sr->against_base);
  EXPECT_TRUE(sr->feedback);
  EXPECT_EQ(sr->pipeline.spec(), "topk:0.02+zstd:1");
  EXPECT_EQ(ExpertCodecSpec::parse(sr->spec())->spec(), sr->spec());
  auto plain = ExpertCodecSpec::parse("topk:0.02");
  ASSERT_TRUE(plain);
  EXPECT_FALSE(plain->against_base);
  EXPECT_FALSE(plain->feedback);
  EXPECT_TRUE(ExpertCodecSpec::parse("raw")->is_raw());
  EXPECT_FALSE(ExpertCodecSpec::parse("ef:raw")->is_raw());
  auto pred = ExpertCodecSpec::parse("sr:ef:pred:topk_sign:0.1+zstd:1");
  ASSERT_TRUE(pred) << pred.status().to_string();
  EXPECT_TRUE(pred->predict);
  EXPECT_FLOAT_EQ(pred->velocity_gain(), 0.1f) << "an entry is corrected about every 1/density steps";
  EXPECT_EQ(ExpertCodecSpec::parse(pred->spec())->spec(), pred->spec());
  EXPECT_FLOAT_EQ(ExpertCodecSpec::parse("ef:pred:bf16")->velocity_gain(), 1.0f);
  EXPECT_FALSE(sr->predict);
  for (const char* bad : {"sr:", "ef:sr:topk:0.1", "sr:sr:bf16", "sr:topk:0", "mean:bf16", "pred:topk:0.1",
                          "sr:pred:ef:topk:0.1", "ef:pred:pred:bf16"}) {
    auto r = ExpertCodecSpec::parse(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find("[sr:][ef:][pred:]PIPELINE"), std::string::npos) << r.status().message();
  }
  const std::pair<const char*, const char*> says[] = {
      {"sr:", "no pipeline"}, {"", "no pipeline"}, {"@5:raw", "a pipeline must come before the first '@'"}};
  for (const auto& [bad, want] : says) {
    auto r = ExpertCodecSpec::parse(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  }
  auto empty = CodecPipeline::parse("");
  ASSERT_FALSE(empty);
  EXPECT_NE(empty.status().message().find("codec '': empty"), std::string::npos) << empty.status().message();
}

TEST(ExpertCodecSpec, AScheduleTakesEachPipelineFromItsStepOnAndRefusesStepsOutOfOrder) {
  auto s = ExpertCodecSpec::parse("sr:ef:topk_sign:1+zstd:1@130:topk_sign:0.05+zstd:1@200:raw");
  ASSERT_TRUE(s) << s.status().to_string();
  ASSERT_EQ(s->later.size(), 2u);
  EXPECT_EQ(s->pipeline_at(0).spec(), "topk_sign:1+zstd:1");
  EXPECT_EQ(s->pipeline_at(129).spec(), "topk_sign:1+zstd:1");
  const std::string sparse = CodecPipeline::parse("topk_sign:0.05+zstd:1")->spec();
  EXPECT_EQ(s->pipeline_at(130).spec(), sparse);
  EXPECT_EQ(s->pipeline_at(199).spec(), sparse);
  EXPECT_TRUE(s->pipeline_at(200).is_raw());
  EXPECT_EQ(ExpertCodecSpec::parse(s->spec())->spec(), s->spec());
  EXPECT_FALSE(ExpertCodecSpec::parse("raw@10:bf16")->is_raw()) << "a later pipeline still codes";
  EXPECT_TRUE(ExpertCodecSpec::parse("raw@10:raw")->is_raw());
  for (const char* bad : {"sr:bf16@0:raw", "sr:bf16@10:raw@10:bf16", "sr:bf16@20:raw@10:bf16", "sr:bf16@x:raw",
                          "sr:bf16@10", "sr:bf16@", "sr:bf16@-3:raw", "sr:bf16@99999999999999999999:raw",
                          "sr:bf16@10:nope", "sr:bf16@10:sr:bf16"}) {
    auto r = ExpertCodecSpec::parse(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.status().message().find("@STEP:PIPELINE"), std::string::npos) << r.status().message();
  }
  auto pred = ExpertCodecSpec::parse("sr:ef:pred:topk:0.1@5:bf16");
  ASSERT_FALSE(pred);
  EXPECT_NE(pred.status().message().find("pred: takes one pipeline"), std::string::npos) << pred.status().message();
}

}  // namespace
}  // namespace xd
