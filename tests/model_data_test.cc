// Tests for the data pipeline: ByteTokenizer, builtin_corpus, BatchSampler.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "model/batch_sampler.h"
#include "model/byte_tokenizer.h"
#include "model/corpus.h"

namespace xd {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::path(testing::TempDir()) / ("xd_data_test_" + name)).string();
}

void write_file(const std::string& path, const std::string& contents) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr) << path;
  ASSERT_EQ(std::fwrite(contents.data(), 1, contents.size(), file), contents.size());
  std::fclose(file);
}

// Generated once: several tests inspect the same default corpus.
const std::string& default_corpus() {
  static const std::string corpus = builtin_corpus();
  return corpus;
}

// H(X_t | X_{t-1}) in nats: what the best model with one byte of context scores.
double bigram_conditional_entropy_nats(const std::vector<int32_t>& tokens) {
  std::vector<double> pair_counts(256 * 256, 0.0), prev_counts(256, 0.0);
  for (size_t i = 1; i < tokens.size(); ++i) {
    pair_counts[static_cast<size_t>(tokens[i - 1] * 256 + tokens[i])] += 1;
    prev_counts[static_cast<size_t>(tokens[i - 1])] += 1;
  }
  const double pairs = static_cast<double>(tokens.size() - 1);
  double entropy = 0.0;
  for (size_t i = 0; i < pair_counts.size(); ++i) {
    if (pair_counts[i] == 0) continue;
    const double conditional = pair_counts[i] / prev_counts[i / 256];
    entropy -= pair_counts[i] / pairs * std::log(conditional);
  }
  return entropy;
}

std::vector<std::string> split_paragraphs(const std::string& text) {
  std::vector<std::string> paragraphs;
  size_t start = 0;
  for (size_t end; (end = text.find("\n\n", start)) != std::string::npos; start = end + 2) {
    paragraphs.push_back(text.substr(start, end - start + 1));
  }
  return paragraphs;  // the cut-off tail is dropped on purpose
}

// ---- ByteTokenizer -----------------------------------------------------------

TEST(ByteTokenizer, EncodeThenDecodeReproducesEveryByte) {
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
  const std::vector<int32_t> tokens = ByteTokenizer::encode(all_bytes);
  ASSERT_EQ(tokens.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tokens[static_cast<size_t>(b)], b);
  EXPECT_EQ(ByteTokenizer::decode(tokens), all_bytes);
  EXPECT_EQ(ByteTokenizer::kVocabSize, 256);
}

TEST(ByteTokenizer, DecodeRendersOutOfRangeTokensAsQuestionMarks) {
  EXPECT_EQ(ByteTokenizer::decode({'h', -1, 'i', 256, 1000}), "h?i??");
}

TEST(ByteTokenizer, EncodeFileReadsTheFileBytes) {
  const std::string path = temp_path("readable.txt");
  const std::string contents = std::string("hello\n\xff\x00world", 13);
  write_file(path, contents);
  Expected<std::vector<int32_t>> tokens = ByteTokenizer::encode_file(path);
  ASSERT_TRUE(tokens.has_value()) << tokens.status().to_string();
  EXPECT_EQ(*tokens, ByteTokenizer::encode(contents));
  std::filesystem::remove(path);
}

TEST(ByteTokenizer, EncodeFileOnAMissingPathIsAnIoErrorNamingThePath) {
  const std::string path = temp_path("does_not_exist.txt");
  Expected<std::vector<int32_t>> tokens = ByteTokenizer::encode_file(path);
  ASSERT_FALSE(tokens.has_value());
  EXPECT_EQ(tokens.status().code(), Status::Code::kIoError);
  EXPECT_NE(tokens.status().message().find(path), std::string::npos)
      << tokens.status().message();
}

TEST(ByteTokenizer, EncodeFileOnADirectoryIsAnIoError) {
  Expected<std::vector<int32_t>> tokens = ByteTokenizer::encode_file(testing::TempDir());
  ASSERT_FALSE(tokens.has_value());
  EXPECT_EQ(tokens.status().code(), Status::Code::kIoError) << tokens.status().to_string();
}

TEST(ByteTokenizer, EncodeFileOnAnEmptyFileIsAnInvalidArgument) {
  const std::string path = temp_path("empty.txt");
  write_file(path, "");
  Expected<std::vector<int32_t>> tokens = ByteTokenizer::encode_file(path);
  ASSERT_FALSE(tokens.has_value());
  EXPECT_EQ(tokens.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(tokens.status().message().find(path), std::string::npos);
  std::filesystem::remove(path);
}

// ---- builtin_corpus ----------------------------------------------------------

TEST(Corpus, TheSameSeedGivesTheSameBytes) {
  EXPECT_EQ(builtin_corpus(), default_corpus());
  EXPECT_EQ(builtin_corpus(99, 5000), builtin_corpus(99, 5000));
}

TEST(Corpus, DifferentSeedsGiveDifferentBytes) {
  EXPECT_NE(builtin_corpus(1, 5000), builtin_corpus(2, 5000));
}

TEST(Corpus, HasExactlyTheRequestedSize) {
  EXPECT_EQ(default_corpus().size(), size_t{1} << 20);
  EXPECT_EQ(builtin_corpus(7, 1).size(), 1u);
  EXPECT_EQ(builtin_corpus(7, 12345).size(), 12345u);
}

TEST(Corpus, ContainsEveryDomain) {
  const std::string& corpus = default_corpus();
  EXPECT_NE(corpus.find(" the "), std::string::npos) << "prose";
  EXPECT_NE(corpus.find("+"), std::string::npos) << "arithmetic";
  EXPECT_NE(corpus.find("fn "), std::string::npos) << "code";
  EXPECT_NE(corpus.find("  return "), std::string::npos) << "code";
  EXPECT_NE(corpus.find("{\"id\": "), std::string::npos) << "json records";
  EXPECT_NE(corpus.find("; user="), std::string::npos) << "key=value records";
  EXPECT_NE(corpus.find(">seq"), std::string::npos) << "dna";
}

TEST(Corpus, IsPrintableTextWithoutControlBytesOtherThanNewline) {
  for (unsigned char c : default_corpus()) {
    ASSERT_TRUE(c == '\n' || (c >= 0x20 && c < 0x7f)) << static_cast<int>(c);
  }
}

// Reads the unsigned decimal number at text[*at], advancing *at past it.
bool read_number(const std::string& text, size_t* at, long* value) {
  const size_t start = *at;
  *value = 0;
  while (*at < text.size() && std::isdigit(static_cast<unsigned char>(text[*at]))) {
    *value = *value * 10 + (text[(*at)++] - '0');
  }
  return *at > start;
}

// Parses exactly "<a><op><b>=<result>" (op one of + - *); anything else is not a
// fact. Hand-written because std::regex trips GCC 12 -Wmaybe-uninitialized.
bool parse_fact(const std::string& line, long* a, char* op, long* b, long* result) {
  size_t at = 0;
  if (!read_number(line, &at, a) || at == line.size()) return false;
  *op = line[at++];
  if (*op != '+' && *op != '-' && *op != '*') return false;
  if (!read_number(line, &at, b) || at == line.size() || line[at++] != '=') return false;
  return read_number(line, &at, result) && at == line.size();
}

TEST(Corpus, ArithmeticFactsAreAllCorrect) {
  std::istringstream lines(builtin_corpus(5, 200000));
  int checked = 0;
  for (std::string line; std::getline(lines, line);) {
    long a = 0, b = 0, result = 0;
    char op = 0;
    if (!parse_fact(line, &a, &op, &b, &result)) continue;
    const long expected = op == '+' ? a + b : op == '-' ? a - b : a * b;
    EXPECT_EQ(result, expected) << line;
    ++checked;
  }
  EXPECT_GT(checked, 500);
}

TEST(Corpus, CodeFunctionsHaveBalancedBraces) {
  int functions = 0;
  for (const std::string& paragraph : split_paragraphs(builtin_corpus(6, 200000))) {
    if (paragraph.rfind("fn ", 0) != 0) continue;
    int depth = 0;
    for (char c : paragraph) {
      depth += c == '{' ? 1 : c == '}' ? -1 : 0;
      ASSERT_GE(depth, 0) << paragraph;
    }
    EXPECT_EQ(depth, 0) << paragraph;
    EXPECT_EQ(paragraph.substr(paragraph.size() - 2), "}\n");
    ++functions;
  }
  EXPECT_GT(functions, 50);
}

TEST(Corpus, UnigramEntropyIsWellBelowUniformBytesButNotDegenerate) {
  const double entropy = unigram_entropy_nats(ByteTokenizer::encode(default_corpus()));
  EXPECT_LT(entropy, std::log(256.0) - 1.0);
  EXPECT_GT(entropy, 2.5);  // dozens of bytes in real use, not a handful
}

TEST(Corpus, OneByteOfContextClearlyBeatsTheUnigramBaseline) {
  const std::vector<int32_t> tokens = ByteTokenizer::encode(default_corpus());
  const double unigram = unigram_entropy_nats(tokens);
  const double bigram = bigram_conditional_entropy_nats(tokens);
  EXPECT_LT(bigram, unigram - 1.0) << "unigram " << unigram << " bigram " << bigram;
}

TEST(Corpus, UnigramEntropyMatchesKnownDistributions) {
  EXPECT_DOUBLE_EQ(unigram_entropy_nats({}), 0.0);
  EXPECT_DOUBLE_EQ(unigram_entropy_nats({7, 7, 7}), 0.0);
  EXPECT_NEAR(unigram_entropy_nats({0, 1, 2, 3, 0, 1, 2, 3}), std::log(4.0), 1e-12);
  EXPECT_NEAR(unigram_entropy_nats({5, 300}), std::log(2.0), 1e-12);
}

// ---- BatchSampler ------------------------------------------------------------

// Token i has value i, so a row's values reveal the window it was cut from.
std::shared_ptr<const std::vector<int32_t>> counting_tokens(int n) {
  auto tokens = std::make_shared<std::vector<int32_t>>(static_cast<size_t>(n));
  std::iota(tokens->begin(), tokens->end(), 0);
  return tokens;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

std::vector<Batch> draw(BatchSampler& sampler, int count) {
  std::vector<Batch> batches(static_cast<size_t>(count));
  for (Batch& b : batches) sampler.next(&b.inputs, &b.targets);
  return batches;
}

TEST(BatchSampler, TheSameSeedDrawsTheSameBatches) {
  auto tokens = counting_tokens(10000);
  BatchSampler a(tokens, 4, 16, 42), b(tokens, 4, 16, 42), other(tokens, 4, 16, 43);
  const std::vector<Batch> from_a = draw(a, 5);
  EXPECT_EQ(from_a, draw(b, 5));
  EXPECT_NE(from_a, draw(other, 5));
}

TEST(BatchSampler, ConsecutiveBatchesDiffer) {
  BatchSampler sampler(counting_tokens(10000), 4, 16, 42);
  const std::vector<Batch> batches = draw(sampler, 2);
  EXPECT_NE(batches[0], batches[1]);
}

TEST(BatchSampler, TargetsAreInputsShiftedByOneWithinEachWindow) {
  const int batch_size = 3, seq_len = 8;
  BatchSampler sampler(counting_tokens(500), batch_size, seq_len, 7);
  for (const Batch& batch : draw(sampler, 10)) {
    ASSERT_EQ(batch.inputs.size(), static_cast<size_t>(batch_size * seq_len));
    ASSERT_EQ(batch.targets.size(), batch.inputs.size());
    for (int row = 0; row < batch_size; ++row) {
      const int32_t start = batch.inputs[static_cast<size_t>(row * seq_len)];
      for (int t = 0; t < seq_len; ++t) {
        const size_t i = static_cast<size_t>(row * seq_len + t);
        EXPECT_EQ(batch.inputs[i], start + t);       // a contiguous window
        EXPECT_EQ(batch.targets[i], start + t + 1);  // its next tokens
      }
    }
  }
}

TEST(BatchSampler, WindowsCoverBothEndsOfTheTokenVectorAndNeverOverrun) {
  const int seq_len = 5, extra_offsets = 3;
  BatchSampler sampler(counting_tokens(seq_len + extra_offsets), 2, seq_len, 1);
  std::set<int32_t> starts;
  for (const Batch& batch : draw(sampler, 200)) {
    for (int row = 0; row < 2; ++row) {
      starts.insert(batch.inputs[static_cast<size_t>(row * seq_len)]);
    }
  }
  EXPECT_EQ(starts, (std::set<int32_t>{0, 1, 2}));
}

TEST(BatchSampler, PositionCountsTheBatchesDrawn) {
  BatchSampler sampler(counting_tokens(1000), 2, 4, 3);
  EXPECT_EQ(sampler.position(), 0u);
  draw(sampler, 7);
  EXPECT_EQ(sampler.position(), 7u);
}

TEST(BatchSampler, ResumingAtAPositionReproducesTheSameBatches) {
  auto tokens = counting_tokens(100000);
  BatchSampler uninterrupted(tokens, 4, 32, 11);
  const std::vector<Batch> full_run = draw(uninterrupted, 20);

  BatchSampler resumed(tokens, 4, 32, 11);
  resumed.set_position(12);
  const std::vector<Batch> tail = draw(resumed, 8);
  EXPECT_EQ(tail, std::vector<Batch>(full_run.begin() + 12, full_run.end()));
  EXPECT_EQ(resumed.position(), 20u);

  resumed.set_position(3);  // going back works too
  EXPECT_EQ(draw(resumed, 1)[0], full_run[3]);
}

TEST(BatchSampler, ShardsTogetherDrawTheSameGlobalBatchAsOneSampler) {
  const int num_shards = 4, batch_size = 3, seq_len = 16;
  auto tokens = counting_tokens(100000);
  BatchSampler global(tokens, batch_size * num_shards, seq_len, 5);
  std::vector<BatchSampler> shards;
  for (int s = 0; s < num_shards; ++s) shards.emplace_back(tokens, batch_size, seq_len, 5, s, num_shards);

  for (int step = 0; step < 6; ++step) {
    Batch expected, joined;
    global.next(&expected.inputs, &expected.targets);
    for (BatchSampler& shard : shards) {
      Batch part;
      shard.next(&part.inputs, &part.targets);
      joined.inputs.insert(joined.inputs.end(), part.inputs.begin(), part.inputs.end());
      joined.targets.insert(joined.targets.end(), part.targets.begin(), part.targets.end());
    }
    EXPECT_EQ(joined, expected) << "step " << step;
  }
}

TEST(BatchSampler, ShardsDrawDisjointRowsForTheSameBatch) {
  const int num_shards = 3, batch_size = 8, seq_len = 16;
  auto tokens = counting_tokens(1000000);
  for (uint64_t batch_index : {0ull, 1ull, 1000ull}) {
    std::map<size_t, int> owner_of_offset;
    for (int s = 0; s < num_shards; ++s) {
      BatchSampler shard(tokens, batch_size, seq_len, 9, s, num_shards);
      for (int row = 0; row < batch_size; ++row) {
        const size_t offset = shard.window_offset(batch_index, row);
        auto [it, inserted] = owner_of_offset.emplace(offset, s);
        EXPECT_TRUE(inserted || it->second == s)
            << "offset " << offset << " drawn by shards " << it->second << " and " << s;
      }
    }
  }
}

TEST(BatchSampler, ValidateNamesEachBadArgument) {
  EXPECT_TRUE(BatchSampler::validate(100, 4, 16, 0, 1).is_ok());
  EXPECT_TRUE(BatchSampler::validate(17, 4, 16, 1, 2).is_ok());  // exactly one window fits
  struct Case { size_t tokens; int batch, seq, shard, shards; const char* mentions; };
  for (const Case& c : {Case{16, 4, 16, 0, 1, "17"}, Case{100, 0, 16, 0, 1, "batch_size"},
                        Case{100, 4, -1, 0, 1, "seq_len"}, Case{100, 4, 16, 0, 0, "num_shards"},
                        Case{100, 4, 16, 2, 2, "shard 2"}, Case{100, 4, 16, -1, 2, "shard -1"}}) {
    const Status status = BatchSampler::validate(c.tokens, c.batch, c.seq, c.shard, c.shards);
    EXPECT_EQ(status.code(), Status::Code::kInvalidArgument) << c.mentions;
    EXPECT_NE(status.message().find(c.mentions), std::string::npos) << status.message();
  }
}

TEST(BatchSamplerDeathTest, ConstructingWithTooFewTokensIsABrokenInvariant) {
  EXPECT_DEATH(BatchSampler(counting_tokens(8), 1, 8, 0), "seq_len \\+ 1");
}

}  // namespace
}  // namespace xd
