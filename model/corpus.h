// builtin_corpus: a deterministic synthetic training text, so examples, tests and
// benchmarks need no data download. The bytes depend only on (seed, bytes): the
// generator uses its own integer RNG and no floating-point-dependent library
// distributions, so every machine and compiler produces the identical corpus.
//
// The text interleaves paragraphs from five domains with very different byte
// statistics (English-like prose from a small grammar, correct arithmetic facts,
// a braces-and-indentation code language, JSON / key=value records, DNA-like
// repeats with mutations). Each domain has rules a small byte-level transformer
// can learn, and a router can profit from sending each domain to its own experts.
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace xd {

// Exactly `bytes` bytes of text (the last paragraph is cut off at the limit).
std::string builtin_corpus(uint64_t seed = 1234, size_t bytes = 1 << 20);

// Entropy in nats of the token frequency distribution: the loss of the best model
// that ignores context, i.e. the baseline a trained model must beat. 0 for empty
// input. Tokens must be non-negative.
double unigram_entropy_nats(const std::vector<int32_t>& tokens);

}  // namespace xd
